"""Text, JSON and job-spec output of a plan, and `--explain` for one layout."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.plan.calibration import how_sure, how_sure_lines
from toolkit.plan.checkpoint_cost import checkpoint_cost, checkpoint_lines, plan_checkpoint
from toolkit.plan.dpo import holds_reference_copy
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import CATEGORIES, WITH_REFERENCE
from toolkit.plan.search import Candidate, Plan, evaluate, layout_violations, simplicity_reason
from toolkit.plan.units import bytes_text, count_text, flops_text, time_unit
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape

GB = 1e9
SHORT = {"parameters": "par", "gradients": "grd", "optimizer": "opt", "activations": "act", "buffers": "buf",
         "overhead": "ovh", "reference": "ref"}


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


def candidate_dict(candidate: Candidate, *, moe: bool = False) -> dict:
    """One layout's figures; an MoE model's also name ep, the expert parameters per GPU and the all-to-all."""
    lay, mem, t = candidate.layout, candidate.memory, candidate.time
    found = {
        "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "zero_stage": lay.zero_stage,
        "micro_batch_size": lay.micro_batch_size, "recompute": lay.recompute, "cp": lay.cp, "sequence_parallel": lay.sp,
        "offload_optimizer": lay.offload_optimizer,
        "memory_gb": round(mem.total_bytes / GB, 3),
        "memory_breakdown_gb": {k: round(v / GB, 3) for k, v in mem.by_category().items()},
        "worst_stage": mem.worst.stage, "fits": mem.fits,
        "step_time_s": round(t.step_time_s, 4), "tokens_per_s": round(t.tokens_per_s, 1), "mfu": round(t.mfu, 4),
        "bubble_fraction": round(t.bubble_fraction, 4),
        "step_breakdown_s": {k: round(getattr(t, f), 4) for k, f in step_parts(moe=moe, reference=t.reference_s > 0)
                             .items()},
        "dp_hidden_s": round(t.dp_hidden_s, 4),
    }
    if moe:
        found.update(ep=lay.ep, expert_params_per_gpu=mem.expert_params_per_gpu)
    return found


# The terms that add up to a step (timing.StepTime), in the order --explain prints them.
STEP_PARTS = {"compute": "compute_s", "memory_bound": "elementwise_s", "tp_comm": "tp_comm_s", "cp_ring": "cp_comm_s",
              "pp_p2p": "pp_comm_s", "bubble": "bubble_s", "dp_comm_exposed": "dp_comm_s", "optimizer": "optimizer_s"}


def step_parts(*, moe: bool, reference: bool = False) -> dict[str, str]:
    """STEP_PARTS, with the expert-parallel token all-to-all after the CP ring for an MoE model, and DPO's live
    reference forward pass last when the step runs one."""
    parts = {}
    for name, field in STEP_PARTS.items():
        parts[name] = field
        if name == "cp_ring" and moe:
            parts["ep_all_to_all"] = "ep_comm_s"
    return parts | ({"reference_forward": "reference_s"} if reference else {})


def model_line(shape: ModelShape) -> str:
    """The model's size and shape (an MoE model's active parameters per token; MLA's latent widths)."""
    active = f" ({shape.active_params() / 1e9:.2f} B active per token)" if shape.is_moe else ""
    if shape.mla:
        m = shape.mla
        q = f"q latent {m.q_lora_rank}" if m.q_lora_rank else "plain q projection"
        heads = (f"heads {shape.num_attention_heads} with multi-latent attention ({q}, kv latent {m.kv_lora_rank}, "
                 f"q/k head {m.qk_nope_head_dim}+{m.qk_rope_head_dim}, v head {m.v_head_dim})")
    else:
        heads = f"heads {shape.num_attention_heads}/{shape.num_kv_heads} KV"
    return (f"model {shape.name}: {shape.num_params() / 1e9:.2f} B params{active}, {shape.num_layers} layers, hidden "
            f"{shape.hidden_size}, {heads}, vocab {shape.vocab_size}")


def _layer_ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'."""
    runs, start = [], None
    for i, layer in enumerate(layers):
        start = layer if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            runs.append(f"{start}-{layer}" if layer > start else f"{layer}")
            start = None
    return ", ".join(runs)


def moe_lines(*, shape: ModelShape, assumptions) -> list[str]:
    """An MoE model's experts and the routing assumption the plan rests on (nothing for a dense model)."""
    if not shape.is_moe:
        return []
    width = shape.shared_expert_ffn_hidden_size
    shared = (f", plus {'a gated' if shape.shared_expert_gate else 'an'} always-active shared-expert MLP of width "
              f"{width}") if width else ""
    one = len(shape.dense_layers) == 1
    dense = (f"; {'layer' if one else 'layers'} {_layer_ranges(shape.dense_layers)} {'is' if one else 'are'} dense "
             f"(MLP width {shape.ffn_hidden_size})" if shape.dense_layers else "")
    return [f"experts: {shape.num_experts} per layer of width {shape.moe_ffn_hidden_size}, top-{shape.moe_topk} "
            f"routed{shared}{dense}; assumption router_imbalance = {assumptions.router_imbalance} (the busiest EP "
            f"rank receives {assumptions.router_imbalance:g} x the mean routed tokens, capped at ep; "
            "--router-imbalance)"]


def choice_note(result: Plan) -> str:
    """How the top choice was made: the fastest prediction, or a simpler layout predicted within the time model's
    uncertainty of a faster one (both named, with the margin)."""
    best, fastest, u = result.best, result.fastest, result.assumptions.time_uncertainty
    if best is None:
        return ""
    if not result.preferred_for_simplicity:
        return f"choice: #1 is the fastest prediction and the simplest layout within its {u:.0%} uncertainty"
    margin = best.time.step_time_s / fastest.time.step_time_s - 1
    reason = simplicity_reason(simpler=best.layout, other=fastest.layout, cluster=result.cluster)
    return (f"choice: {best.layout.label()} is preferred for simplicity ({reason}) over the fastest prediction, "
            f"{fastest.layout.label()}: that one is predicted {margin:.1%} faster, within the time model's {u:.0%} "
            "uncertainty (--time-uncertainty 0 ranks by predicted time alone)")


def plan_dict(result: Plan, *, top: int) -> dict:
    c, moe = result.cluster, result.shape.is_moe
    found = {
        "model": result.shape.name, "num_params": result.shape.num_params(),
        "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu": c.gpu.name,
                    "gpu_memory_gb": round(c.gpu.memory_gb, 2)},
        "training": {"seq_length": result.training.seq_length,
                     "global_batch_size": result.training.global_batch_size,
                     "lora_rank": None if result.training.lora is None else result.training.lora.rank,
                     "dpo": None if result.training.dpo is None else dataclasses.asdict(result.training.dpo)},
        "evaluated": result.evaluated,
        "choice": {"preferred_for_simplicity": result.preferred_for_simplicity,
                   "time_uncertainty": result.assumptions.time_uncertainty,
                   "fastest": result.fastest.layout.label() if result.fastest else None, "note": choice_note(result)},
        "search_limits": result.limits.describe() or None,
        "how_sure": (how_sure(candidate=result.best, shape=result.shape, cluster=c, assumptions=result.assumptions)
                     if result.best else None),
        "checkpoint": None if result.best is None else plan_checkpoint(result).as_dict(),  # of the choice
        "layouts": [candidate_dict(x, moe=moe) for x in result.fitting[:top]],
        "rejected": [dict(candidate_dict(x, moe=moe), reason=rejection_reason(x)) for x in result.rejected],
    }
    if moe:
        shape = result.shape
        found["moe"] = {"num_experts": shape.num_experts, "moe_topk": shape.moe_topk,
                        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
                        "router_imbalance": result.assumptions.router_imbalance}
        found["num_active_params"] = shape.active_params()
        if shape.shared_expert_ffn_hidden_size:
            found["moe"].update(shared_expert_ffn_hidden_size=shape.shared_expert_ffn_hidden_size,
                                shared_expert_gate=shape.shared_expert_gate)
        if shape.dense_layers:
            found["moe"].update(dense_layers=list(shape.dense_layers), ffn_hidden_size=shape.ffn_hidden_size)
    if result.shape.mla:
        found["mla"] = dataclasses.asdict(result.shape.mla)
    return found


def _layout_cells(lay: PlanLayout, *, moe: bool = False) -> str:
    rec = {"none": "-", "selective": "sel", "full": "full"}[lay.recompute]
    off = "+off" if lay.offload_optimizer else ""
    ep = f" {lay.ep:>3}" if moe else ""
    return (f"{lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.vpp:>3}{ep} {lay.dp:>5} {lay.zero_stage:>3}{off:<4} "
            f"{lay.micro_batch_size:>3} {rec:>5}")


def _lora_line(*, shape, training) -> list[str]:
    """The adapters of the whole model (every expert's); per GPU the plan counts its stage's layers and E / ep
    experts (toolkit/plan/lora.py)."""
    from toolkit.plan.lora import PROJECTIONS, lora_params, projection_sizes

    if training.lora is None:
        return []
    adapters = lora_params(shape=shape, lora=training.lora)
    names = [name for name in PROJECTIONS if name in training.lora.projections and name in projection_sizes(shape)]
    return [f"LoRA rank {training.lora.rank} on {', '.join(names)}: {adapters / 1e6:.1f} M "
            f"trainable parameters ({adapters / shape.num_params():.2%}); gradients and optimizer state for those "
            "only (the step time still counts full backward FLOPs)"]


def dpo_lines(*, training: TrainingShape, candidate: Candidate | None) -> list[str]:
    """DPO's terms (toolkit/plan/dpo.py): how a micro-batch counts, the reference's weights and its forward, with
    `candidate`'s figures (the choice, or the explained layout)."""
    if (dpo := training.dpo) is None:
        return []
    lines = [f"DPO: {dpo.describe()}"]
    if not dpo.live_reference:
        return lines + ["  reference log-probs precomputed: no reference weights and no reference forward in the "
                        "step; one forward pass over the training pairs before step 1 (not in the step time)"]
    if holds_reference_copy(training):
        weights = ("  reference weights: a frozen copy in the training dtype at the layout's TP x PP, whole on "
                   "every data-parallel rank (not partitioned by ZeRO), no gradients or optimizer state (ref)")
        weights += f"; {bytes_text(candidate.memory.reference)} per GPU" if candidate else ""
    else:
        weights = "  reference weights 0 GB: the LoRA policy with its adapters off, no second copy"
    forward = ("  reference forward: one extra forward per micro-batch, a forward-only pipeline pass before the "
               "policy's (~+33% compute; ~+25% under full recompute, whose step already re-runs each forward)")
    if candidate:
        t = candidate.time
        forward += f"; {t.reference_s:.3g} s per step, {t.reference_s / (t.step_time_s - t.reference_s):+.0%}"
    return lines + [weights, forward]


def format_table(result: Plan, *, top: int) -> str:
    c, shape, tr = result.cluster, result.shape, result.training
    moe = shape.is_moe
    categories = WITH_REFERENCE if holds_reference_copy(tr) else CATEGORIES
    lines = [
        model_line(shape),
        f"cluster {c.nodes} x {c.gpus_per_node} {c.gpu.name} ({c.gpu.memory_gb:.1f} GB, "
        f"{c.gpu.peak_bf16_tflops:.0f} TF bf16); seq {tr.seq_length}, global batch {tr.global_batch_size}; "
        f"{result.evaluated} layouts evaluated, {len(result.fitting)} fit",
        *([f"search limited to: {result.limits.describe()}"] if result.limits.describe() else []),
        *_lora_line(shape=shape, training=tr),
        *dpo_lines(training=tr, candidate=result.best),
        *moe_lines(shape=shape, assumptions=result.assumptions),
        "",
        f"{'#':>3}  {'tp':>3} {'cp':>3} {'pp':>3} {'vpp':>3}{'  ep' if moe else ''} {'dp':>5} {'zero':<7} {'mbs':>3} "
        f"{'recmp':>5} | "
        f"{'mem GB':>6} = {' + '.join(SHORT[k] for k in categories)} | {'step s':>7} {'tok/s':>9} {'MFU':>5} "
        f"{'bubble':>6}",
    ]
    for rank, x in enumerate(result.fitting[:top], 1):
        parts = " ".join(f"{v / GB:5.1f}" for v in x.memory.by_category().values())
        t = x.time
        lines.append(f"{rank:>3}  {_layout_cells(x.layout, moe=moe)} | {_gb(x.memory.total_bytes):>6} = {parts} | "
                     f"{t.step_time_s:7.2f} {t.tokens_per_s:9.0f} {t.mfu:5.1%} {t.bubble_fraction:6.1%}")
    if not result.fitting:
        lines.append("    no layout fits; see the rejected ones below")
    else:
        lines += ["", choice_note(result)] + _expert_params_line(result.best, shape=shape)
        lines += how_sure_lines(candidate=result.best, shape=shape, cluster=c, assumptions=result.assumptions)
        lines += checkpoint_lines(plan_checkpoint(result), label="checkpoint of #1")
    if result.rejected:
        header = ("best rejected (faster than the winner, but do not fit):" if result.fitting else
                  "closest to fitting (none fits: add GPUs, shorten the sequence, or try --allow-offload):")
        lines += ["", header]
        lines += [f"  {x.layout.label()}: {rejection_reason(x)}" for x in result.rejected]
    return "\n".join(lines)


def _expert_params_line(candidate: Candidate, *, shape: ModelShape) -> list[str]:
    """The chosen layout's expert parameters per GPU (an MoE model only)."""
    if not shape.is_moe:
        return []
    mem, lay = candidate.memory, candidate.layout
    return [f"#1 holds {mem.params_per_gpu / 1e9:.2f} B parameters per GPU, {mem.expert_params_per_gpu / 1e9:.2f} B "
            f"of them experts (ep={lay.ep}: {shape.num_experts // lay.ep} experts per layer on each rank, each split "
            f"over tp={lay.tp}; their states partitioned over expert_dp={lay.expert_dp})"]


def rejection_reason(candidate: Candidate) -> str:
    mem = candidate.memory
    worst = max(mem.by_category().items(), key=lambda kv: kv[1])
    over = mem.total_bytes - mem.capacity_bytes
    return (f"needs {_gb(mem.total_bytes)} GB on stage {mem.worst.stage} > {_gb(mem.capacity_bytes)} GB "
            f"(over by {_gb(over)} GB; largest: {worst[0]} {_gb(worst[1])} GB)")


def parse_layout(text: str, *, cluster: Cluster) -> PlanLayout:
    """`"tp=8 pp=4 zero=1 mbs=1"` (also vpp, dp, recompute, sp=on|off, offload=on|off); dp defaults to the rest."""
    aliases = {"zero": "zero_stage", "zero_stage": "zero_stage", "mbs": "micro_batch_size",
               "micro_batch_size": "micro_batch_size", "tp": "tp", "pp": "pp", "vpp": "vpp", "dp": "dp",
               "recompute": "recompute", "sp": "sp", "cp": "cp", "ep": "ep", "offload": "offload_optimizer"}
    values: dict = {}
    for item in text.replace(",", " ").split():
        key, sep, raw = item.partition("=")
        if not sep or key not in aliases:
            raise DsmtError(f"cannot read {item!r} in --explain {text!r}; use key=value with keys "
                            f"{', '.join(sorted(aliases))}, e.g. \"tp=8 pp=4 zero=1 mbs=1\"")
        field = aliases[key]
        if field == "recompute":
            values[field] = raw
        elif field in ("sp", "offload_optimizer"):
            values[field] = raw.lower() in ("1", "on", "true", "yes")
        elif not raw.isdigit() or int(raw) < 1 and field != "zero_stage":
            raise DsmtError(f"{key}={raw!r} in --explain must be a positive integer")
        else:
            values[field] = int(raw)
    tp, pp, cp = values.setdefault("tp", 1), values.setdefault("pp", 1), values.setdefault("cp", 1)
    values.setdefault("dp", max(1, cluster.world_size // (tp * pp * cp)))
    values.setdefault("sp", tp > 1)  # the planner proposes sequence parallelism whenever tp > 1
    return PlanLayout(**values)


def explain(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, cluster: Cluster, result: Plan) -> str:
    lines = [f"layout {layout.label()} for {shape.name} on {cluster.nodes} x {cluster.gpus_per_node} "
             f"{cluster.gpu.name}:"] + ["  " + line for line in moe_lines(shape=shape, assumptions=result.assumptions)]
    problems = layout_violations(shape=shape, layout=layout, training=training, cluster=cluster)
    if problems:
        return "\n".join(lines + ["  INVALID:"] + [f"  - {p}" for p in problems])
    x = evaluate(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=result.assumptions)
    verdict = "FITS" if x.fits else "DOES NOT FIT"
    lines.append(f"  memory: {verdict}, {_gb(x.memory.total_bytes)} of {_gb(x.memory.capacity_bytes)} GB on the "
                 f"worst stage ({x.memory.worst.stage})")
    for stage in x.memory.stages:  # each part in its own unit: a small model's show beside the fixed overhead
        cats = ", ".join(f"{k} {bytes_text(v)}" for k, v in stage.by_category().items())
        experts = f" ({count_text(stage.expert_params_per_gpu)} experts)" if shape.is_moe else ""
        lines.append(f"    stage {stage.stage}: {_gb(stage.total_bytes)} GB = {cats}  "
                     f"[{count_text(stage.params_per_gpu)} params/GPU{experts}, {stage.micro_batches_in_flight:g} "
                     f"micro-batches in flight]")
    lines += _time_lines(x.time, moe=shape.is_moe)
    lines += ["  " + line for line in dpo_lines(training=training, candidate=x)]
    lines += checkpoint_lines(checkpoint_cost(shape=shape, layout=layout, training=training, cluster=cluster,
                                              assumptions=result.assumptions), indent="  ")
    lines += how_sure_lines(candidate=x, shape=shape, cluster=cluster, assumptions=result.assumptions, indent="  ")
    lines += _rank_lines(x, result)
    return "\n".join(lines)


def _time_lines(t, *, moe: bool = False) -> list[str]:
    """The step and its terms in the step's unit (s, or ms / µs for a small model's step)."""
    scale, unit = time_unit(t.step_time_s)
    parts = " + ".join(f"{name.replace('_', ' ')} {getattr(t, field) / scale:.3f}"
                       for name, field in step_parts(moe=moe, reference=t.reference_s > 0).items())
    a2a = [f"  ep all to all: the MoE token all-to-all (dispatch + combine, forward and backward: 4 per layer and "
           f"micro-batch, 6 with full recompute), {t.ep_comm_s / scale:.3f} {unit} per step, not hidden"] if moe else []
    return [f"  step time {t.step_time_s / scale:.3f} {unit} = {parts}", *a2a, *_dp_lines(t, scale=scale, unit=unit),
        f"  {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%}, bubble (p-1)/(v*m) = {t.bubble_fraction:.1%}, "
        f"{flops_text(t.flops_per_step)} per step",
    ]


def _dp_lines(t, *, scale: float, unit: str) -> list[str]:
    """The data-parallel traffic by phase (toolkit/plan/zero_traffic.py) and the part hidden behind compute, in
    the step's unit."""
    dp = t.dp_traffic
    if dp is None or dp.total_s == 0:
        return ["  data-parallel traffic: none (one replica)"]
    return [f"  data-parallel traffic {dp.total_s / scale:.3f} {unit} per step: beside forward "
            f"{dp.forward_s / scale:.3f} (ZeRO-3 gathers), beside backward {dp.backward_s / scale:.3f} (ZeRO-3 "
            f"gathers, ZeRO-2/3 gradient reductions), after the step {dp.after_step_s / scale:.3f}; hidden behind "
            f"compute {dp.hidden_s / scale:.3f} (only ZeRO-2/3 with overlap_comm at pp = 1 hide any)"]


def _rank_lines(x: Candidate, result: Plan) -> list[str]:
    """Where the explained layout stands in the planner's order, and how the top choice was made."""
    best = result.best
    if best is None:
        return ["  no layout fits, so there is no choice to compare with"]
    if x.layout == best.layout:
        lines = ["  this is the planner's choice (#1)"]
    else:
        rank = next((i for i, c in enumerate(result.fitting, 1) if c.layout == x.layout), None)
        where = f"rank {rank} of {len(result.fitting)} fitting layouts" if rank else "not among the fitting layouts"
        mine, chosen = x.time.step_time_s, best.time.step_time_s
        compared = (f"predicted {mine / chosen - 1:.1%} slower than the choice" if mine >= chosen else
                    f"the choice is predicted {chosen / mine - 1:.1%} slower than this")
        lines = [f"  {where}; {compared} ({best.layout.label()})", _gap_line(x, best, moe=result.shape.is_moe)]
    if result.preferred_for_simplicity:
        lines.append("  " + choice_note(result))
    return lines


def _gap_line(x: Candidate, best: Candidate, *, moe: bool) -> str:
    """The step-time terms that differ most between the explained layout and the choice: why it ranks where it
    does."""
    scale, unit = time_unit(max(x.time.step_time_s, best.time.step_time_s))
    parts = step_parts(moe=moe, reference=x.time.reference_s > 0)
    gaps = [(getattr(x.time, field) - getattr(best.time, field), name) for name, field in parts.items()]
    shown = [gap for gap in gaps if abs(gap[0]) >= 0.0005 * scale]  # not the ones that would print as +0.000
    largest = sorted(shown, key=lambda gap: -abs(gap[0]))[:3]
    named = ", ".join(f"{name.replace('_', ' ')} {gap / scale:+.3f} {unit}" for gap, name in largest)
    return f"  why: the terms that differ most, this layout minus the choice: {named or 'none'}"


def spec_dict(*, model_ref: str, candidate: Candidate, cluster: Cluster, training: TrainingShape,
              attention: str = "fused") -> dict:
    """The job spec `dsmt generate` reads, with exactly the agreed keys (the attention kind the plan assumed)."""
    lay = candidate.layout
    model = {"builtin": model_ref} if model_ref in BUILTIN_SHAPES else {"path": model_ref}
    expert_parallel = {"ep": lay.ep} if lay.ep > 1 else {}  # MoE models; the spec's default is 1
    spec = {
        "model": model,
        "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "gpu": cluster.gpu.name},
        "parallel": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, **expert_parallel,
                     "sequence_parallel": lay.sp,
                     "zero_stage": lay.zero_stage, "offload_optimizer": lay.offload_optimizer},
        "training": {"global_batch_size": training.global_batch_size, "micro_batch_size": lay.micro_batch_size,
                     "seq_length": training.seq_length, "precision": "bf16", "recompute": lay.recompute,
                     "attention": attention},
    }
    if lay.zero_stage == 0:  # bf16 without ZeRO needs bf16 accumulation (dsmt check: fp32_accumulation_needs_zero)
        spec["communication"] = {"grad_accum_dtype": "bf16"}
    if training.lora is not None:  # the plan counted dsmt's default targets (lora.default_projections)
        spec["training"]["lora"] = {"rank": training.lora.rank}
    if training.dpo is not None:  # the pairs' layout the plan counted is data.packing's
        spec["training"].update(method="dpo", dpo={"reference": training.dpo.reference})
    return spec


def write_spec_atomic(*, path: Path, spec: dict) -> None:
    """Write the YAML next to its destination, then rename: readers never see half a file."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(spec, f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
