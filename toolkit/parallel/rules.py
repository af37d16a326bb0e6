"""Which parallel layouts are valid: the one rule set of verify, train, check, generate and plan.

`layout_problems` returns every problem of a layout as structured `Problem`s (rule, values, fix, valid choices);
each front end renders them its own way (`dsmt check` a report, `dsmt plan` a list, the trainer an exception).
Rules that need the run (world, batch, device) are skipped when `run` is None (`dsmt verify`, the model loader).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from toolkit.parallel.layout import Layout, divisors
from toolkit.errors import Problem

# The rules layout_problems can return (a test checks every one is reachable).
LAYOUT_RULES = frozenset({
    "layout_sizes", "world_size", "heads_vs_tp", "kv_heads_vs_tp", "ffn_vs_tp", "vocab_padding", "layers_vs_pp",
    "vpp_needs_pp", "sequence_parallel_needs_tp", "sequence_parallel_vs_seq_length", "fused_attention_on_cpu", "cp_on_cpu", "cp_needs_fused_attention", "cp_vs_seq_length", "cp_with_mla",
    "ep_needs_experts", "experts_vs_ep", "ep_vs_data_parallel", "moe_tp_needs_sequence_parallel", "zero3_with_ep",
    "batch_divisibility", "vpp_microbatches", "zero_with_pp", "tp_crosses_nodes", "attention_softcap_needs_local",
    "local_layers_only",
})

# The rules that need only the layout and the model (no world, batch or device): what the model loader applies.
MODEL_RULES = frozenset({
    "layout_sizes", "heads_vs_tp", "kv_heads_vs_tp", "ffn_vs_tp", "vocab_padding", "layers_vs_pp", "vpp_needs_pp",
    "sequence_parallel_needs_tp", "ep_needs_experts", "experts_vs_ep", "ep_vs_data_parallel",
})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What of the model a layout must divide."""

    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    num_layers: int
    padded_vocab_size: int  # the adapters' padding (toolkit/models/shapes.py): the same for every tp
    num_experts: int = 0  # MoE: experts per layer (0: a dense model)
    kv_heads_replicable: bool = True  # False: tp must divide num_kv_heads (OLMo-2's q / k norms span the heads)
    attention_softcap: float | None = None  # HF attn_logit_softcapping (Gemma 2): megatron's local attention only
    # Other MLP widths TP splits, as (HF name, size): the routed experts' and the shared experts' where they differ
    # from ffn_hidden_size (DeepSeek's dense layers are intermediate_size wide, its experts moe_intermediate_size).
    other_ffn_sizes: tuple[tuple[str, int], ...] = ()
    mla: bool = False  # multi-latent attention (DeepSeek)
    # Head counts TP splits with no replication, as (HF name, count): Qwen3-Next's Gated DeltaNet key and value heads
    # (each rank holds whole key-head groups: toolkit/adapters/qwen3_next_layers.py).
    unreplicated_heads: tuple[tuple[str, int], ...] = ()
    # Why dsmt builds this model on megatron's local layers only (its adapter refuses Transformer Engine's), or None
    local_layers_only: str | None = None

    @classmethod
    def from_shape(cls, shape, *, vocab_multiple: int) -> "ModelFacts":
        from toolkit.models.shapes import padded_vocab_size

        all_moe = shape.is_moe and not shape.dense_layers  # an all-MoE model's MLPs are its experts
        others = ((("moe_intermediate_size", shape.moe_ffn_hidden_size),) if shape.is_moe and not all_moe else ()) \
            + ((("shared experts", shape.shared_expert_ffn_hidden_size),) if shape.shared_expert_ffn_hidden_size else ())
        return cls(num_attention_heads=shape.num_attention_heads, num_kv_heads=shape.num_kv_heads,
                   ffn_hidden_size=shape.moe_ffn_hidden_size if all_moe else shape.ffn_hidden_size,
                   other_ffn_sizes=others, mla=shape.mla is not None,
                   num_layers=shape.num_layers,
                   padded_vocab_size=padded_vocab_size(shape.vocab_size, multiple=vocab_multiple),
                   num_experts=shape.num_experts, attention_softcap=shape.attention_softcap,
                   kv_heads_replicable=shape.kv_heads_replicable, unreplicated_heads=_linear_attention_heads(shape),
                   local_layers_only=shape.local_layers_only)


def _linear_attention_heads(shape) -> tuple[tuple[str, int], ...]:
    gdn = shape.linear_attention
    if gdn is None:
        return ()
    return (("linear_num_key_heads", gdn.num_key_heads), ("linear_num_value_heads", gdn.num_value_heads))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the layout runs on and with."""

    world_size: int
    gpus_per_node: int
    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    zero_stage: int
    device: str = "cuda"  # "cuda" or "cpu"
    attention: str = "fused"  # the resolved attention kind: "fused" (TE / flash) or "local" (unfused)


def resolve_attention(*, attention: str, device: str, encoder: bool = False) -> str:
    """training.attention as it will run: auto is fused on GPUs (Transformer Engine), local on the CPU and for
    encoders (BERT's post-LayerNorm layers are megatron's local ones)."""
    if attention != "auto":
        return attention
    return "fused" if device == "cuda" and not encoder else "local"


Rule = Callable[..., list[Problem]]


def _listing(values) -> str:
    return ", ".join(map(str, values)) or "none"


def valid_tp_sizes(*, model: ModelFacts, limit: int) -> list[int]:
    """TP sizes <= limit that divide the heads, the FFN and the padded vocabulary and either divide the KV heads
    or are a multiple of them (megatron-core replicates each KV head on tp / kv ranks)."""
    kv = model.num_kv_heads
    return [t for t in divisors(limit) if model.num_attention_heads % t == 0 and model.ffn_hidden_size % t == 0
            and all(size % t == 0 for _, size in model.other_ffn_sizes + model.unreplicated_heads)
            and model.padded_vocab_size % t == 0 and (kv % t == 0 or (t % kv == 0 and model.kv_heads_replicable))]


def _tp_problem(rule: str, message: str, *, model: ModelFacts, run: RunFacts | None, layout: Layout) -> Problem:
    limit = run.world_size // (layout.pp * layout.cp) if run and run.world_size % (layout.pp * layout.cp) == 0 else \
        model.num_attention_heads
    valid = tuple(valid_tp_sizes(model=model, limit=limit))
    return Problem("error", rule, message, f"valid tp: {_listing(valid)}", valid)


def rule_sizes(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    bad = {name: value for name, value in layout.parallel_fields().items() if name != "sp" and value < 1}
    if not bad:
        return []
    return [Problem("error", "layout_sizes", ", ".join(f"{k}={v}" for k, v in bad.items()) + " must be >= 1",
                    "use sizes >= 1")]


def rule_world_size(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    if run is None or layout.world_size == run.world_size:
        return []
    world, model_parallel = run.world_size, layout.model_parallel_size
    valid = tuple(t for t in divisors(world) if (world // t) % (layout.pp * layout.cp) == 0)
    if world % model_parallel:
        message = (f"world_size={world} (nodes × gpus_per_node) is not divisible by tp×cp×pp={layout.tp}×{layout.cp}×"
                   f"{layout.pp}={model_parallel}; dp would not be whole")
    else:
        message = (f"world_size={world} (nodes × gpus_per_node) is not tp×cp×dp×pp={layout.tp}×{layout.cp}×{layout.dp}"
                   f"×{layout.pp}={layout.world_size}")
    return [Problem("error", "world_size", message,
                    f"valid tp with pp={layout.pp}, cp={layout.cp}: {_listing(valid)}", valid)]


def rule_tensor_parallel(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """megatron-core splits heads, the FFN and the vocabulary over tp; KV heads are split, or replicated when tp
    is a multiple of their count."""
    tp, kv, found = layout.tp, model.num_kv_heads, []
    checks = (
        ("heads_vs_tp", model.num_attention_heads % tp, f"tp={tp} does not divide num_attention_heads="
                                                        f"{model.num_attention_heads}"),
        ("kv_heads_vs_tp", kv % tp and tp % kv, f"tp={tp} neither divides nor is a multiple of num_kv_heads={kv} "
                                                 "(KV heads are split, or each replicated on tp/kv ranks)"),
        ("kv_heads_vs_tp", kv % tp and not tp % kv and not model.kv_heads_replicable,
         f"tp={tp} does not divide num_kv_heads={kv}, and this model's KV heads cannot be replicated (OLMo-2's q / "
         "k norms span all heads; Qwen3-Next's gated attention splits k and v as they are), so each TP rank needs "
         "whole KV heads"),
        *(("heads_vs_tp", count % tp, f"tp={tp} does not divide {name}={count} (Gated DeltaNet heads are split "
                                      "over TP, none replicated)") for name, count in model.unreplicated_heads),
        ("ffn_vs_tp", model.ffn_hidden_size % tp, f"tp={tp} does not divide ffn_hidden_size={model.ffn_hidden_size}"),
        *(("ffn_vs_tp", size % tp, f"tp={tp} does not divide the {name} width {size}")
          for name, size in model.other_ffn_sizes),
        ("vocab_padding", model.padded_vocab_size % tp, f"tp={tp} does not divide the padded vocabulary "
                                                        f"{model.padded_vocab_size} (model.make_vocab_size_divisible_by "
                                                        "sets the padding)"),
    )
    for rule, broken, message in checks:
        if broken:
            found.append(_tp_problem(rule, message, model=model, run=run, layout=layout))
    if layout.sp and tp == 1:
        found.append(Problem("error", "sequence_parallel_needs_tp", "sequence_parallel=true needs tp > 1 (tp=1): it "
                             "splits the norm and dropout activations over the TP ranks",
                             "set parallel.tp >= 2 or parallel.sequence_parallel: false"))
    return found


def rule_pipeline(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    pp, vpp, layers, found = layout.pp, layout.vpp, model.num_layers, []
    if vpp > 1 and pp == 1:
        found.append(Problem("error", "vpp_needs_pp", f"vpp={vpp} needs pp > 1 (virtual stages interleave a "
                             "pipeline)", "set pp >= 2 or vpp: null", (1,)))
    if layers % (pp * vpp):
        valid_pp = tuple(p for p in divisors(layers) if layers % (p * vpp) == 0)
        fix = f"valid pp with vpp={vpp}: {_listing(valid_pp)}"
        if layers % pp == 0:
            fix += f"; valid vpp with pp={pp}: {_listing(divisors(layers // pp))}"
        found.append(Problem("error", "layers_vs_pp", f"num_layers={layers} is not divisible by pp×vpp={pp}×{vpp}="
                             f"{pp * vpp} (equal stages)", fix, valid_pp))
    return found


def rule_context_parallel(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """megatron-core's CP runs ring attention in Transformer Engine; its local attention has none."""
    cp = layout.cp
    if run is not None and run.device == "cpu" and run.attention == "fused":
        return [Problem("error", "fused_attention_on_cpu", "training.attention=fused with device=cpu: fused attention "
                        "is Transformer Engine's, which needs GPUs", "set training.attention: local (or auto)"
                        + (" and parallel.cp: 1" if cp > 1 else ""))]
    if cp == 1 or run is None:
        return []
    found = []
    if run.device == "cpu":
        found.append(Problem("error", "cp_on_cpu", f"cp={cp} with device=cpu: context parallelism needs Transformer "
                             "Engine's attention on GPUs; megatron's local (CPU) attention has no CP",
                             "set parallel.cp: 1 on CPU", (1,)))
    elif run.attention != "fused":
        found.append(Problem("error", "cp_needs_fused_attention", f"cp={cp} with training.attention={run.attention}: "
                             "megatron's unfused local attention has no context parallelism",
                             "set training.attention: fused (Transformer Engine) or auto, or parallel.cp: 1"))
    if model.mla:
        found.append(Problem("error", "cp_with_mla", f"cp={cp} with multi-latent attention (DeepSeek): dsmt has not run "
                             "megatron-core's MLA under context parallelism (its THD / ring path needs Transformer "
                             "Engine and is untested here)", "set parallel.cp: 1", (1,)))
    if run.seq_length % (2 * cp):  # load balancing splits each sequence into 2·cp chunks
        valid = tuple(c for c in divisors(run.seq_length // 2) if c > 1) if run.seq_length % 2 == 0 else ()
        found.append(Problem("error", "cp_vs_seq_length", f"seq_length={run.seq_length} is not divisible by 2×cp="
                             f"{2 * cp} (megatron splits each sequence into 2·cp chunks to balance causal attention)",
                             f"use a seq_length that is a multiple of {2 * cp}, or cp in: {_listing(valid[:8])}",
                             valid))
    return found


def rule_attention_softcap(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """Softcapped attention scores (Gemma 2) are reproduced on megatron's local attention only (adapters/softcap.py)."""
    if run is None or model.attention_softcap is None or run.attention != "fused":
        return []
    return [Problem("error", "attention_softcap_needs_local", f"attn_logit_softcapping={model.attention_softcap} "
                    "with training.attention=fused: Transformer Engine's attention has no logit softcapping, so the "
                    "model would train without it", "set training.attention: local (megatron's attention, softcapped "
                    "as HF does; it stores the s x s scores: see dsmt plan for the memory)")]


def rule_local_layers_only(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """Qwen3-Next's Gated DeltaNet and Llama 4's chunked, temperature-tuned attention exist on megatron's local
    layers only in dsmt (families/qwen3_next.py, families/llama4.py): Transformer Engine's are refused at build."""
    if run is None or model.local_layers_only is None or run.attention != "fused":
        return []
    return [Problem("error", "local_layers_only", f"{model.local_layers_only} with training.attention=fused: dsmt "
                    "builds these on megatron's local layers only; Transformer Engine's would be refused at build",
                    "set training.attention: local (it stores the s x s attention scores: see dsmt plan for the "
                    "memory)")]


def valid_ep_sizes(*, model: ModelFacts, layout: Layout) -> tuple[int, ...]:
    """ep values that divide the experts and the ranks that share a model replica's weights (dp × cp)."""
    return tuple(e for e in divisors(layout.dp * layout.cp) if model.num_experts % e == 0)


def rule_expert_parallel(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """megatron-core's expert grid is etp × ep × edp × pp = world with the expert TP size etp = tp, so ep must divide
    dp × cp; each rank holds num_experts / ep whole experts."""
    ep, experts = layout.ep, model.num_experts
    if ep == 1:
        return []
    if experts == 0:
        return [Problem("error", "ep_needs_experts", f"ep={ep} with a dense model: expert parallelism splits the "
                        "experts of a mixture-of-experts model (Mixtral, Qwen3-MoE), and this model has none",
                        "use ep: 1", (1,))]
    valid = valid_ep_sizes(model=model, layout=layout)
    found = []
    if experts % ep:
        found.append(Problem("error", "experts_vs_ep", f"ep={ep} does not divide num_experts={experts}: each EP rank "
                             "holds num_experts / ep whole experts", f"valid ep: {_listing(valid)}", valid))
    if (layout.dp * layout.cp) % ep:
        found.append(Problem("error", "ep_vs_data_parallel", f"ep={ep} does not divide dp×cp={layout.dp}×{layout.cp}="
                             f"{layout.dp * layout.cp}: megatron-core places the EP groups inside the data-parallel "
                             "ranks (world = tp × ep × expert-dp × pp)", f"valid ep: {_listing(valid)}; or change "
                             "the world so that dp is a multiple of ep", valid))
    return found


def rule_moe_training(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """Training an MoE model: megatron-core refuses tp > 1 without sequence parallelism (its token dispatcher
    expects each TP rank's own tokens), and DeepSpeed refuses ZeRO-3 with expert-parallel parameters."""
    if run is None or model.num_experts == 0:
        return []
    found = []
    if layout.tp > 1 and not layout.sp:
        found.append(Problem("error", "moe_tp_needs_sequence_parallel", f"tp={layout.tp} with a mixture-of-experts "
                             "model: megatron-core trains MoE layers with tensor parallelism only under sequence "
                             "parallelism", "set parallel.sequence_parallel: true (or tp: 1)"))
    if layout.ep > 1 and run.zero_stage == 3:
        found.append(Problem("error", "zero3_with_ep", f"zero_stage=3 with ep={layout.ep}: DeepSpeed's ZeRO-3 does "
                             "not partition expert-parallel parameters (engine: 'MoE not supported with Stage 3')",
                             "use zero_stage 1 or 2 with ep > 1, or ep: 1", (0, 1, 2)))
    return found


def rule_batch(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """DeepSpeed asserts train_batch_size = micro × accumulation × dp; the interleaved schedule runs micro-batches in
    groups of pp (megatron-core's microbatch_group_size_per_vp_stage, left at its default)."""
    if run is None or layout.world_size != run.world_size:
        return []  # the world rule says why dp is not whole
    dp, micro, batch = layout.dp, run.micro_batch_size, run.global_batch_size
    unit = micro * dp
    if batch % unit:
        below, above = batch // unit * unit, (batch // unit + 1) * unit
        valid_micro = tuple(divisors(batch // dp)) if batch % dp == 0 else ()
        fix = f"nearest valid global_batch_size: {_listing(v for v in (below, above) if v)}"
        if valid_micro:
            fix += f"; or micro_batch_size in: {_listing(valid_micro)}"
        return [Problem("error", "batch_divisibility", f"global_batch_size={batch} is not divisible by micro_batch_size"
                        f"×dp={micro}×{dp}={unit} (DeepSpeed requires train_batch_size = micro × grad_accum × dp)",
                        fix, valid_micro)]
    num_microbatches = batch // unit
    if layout.vpp > 1 and num_microbatches % layout.pp:
        return [Problem("error", "vpp_microbatches", f"interleaved pipeline (vpp={layout.vpp}) needs num_microbatches "
                        f"to be a multiple of pp={layout.pp}; got {num_microbatches} (global_batch_size / "
                        f"(micro_batch_size×dp={micro}×{dp}))", f"use a global_batch_size that is a multiple of "
                        f"pp×micro×dp={layout.pp * unit}, or set vpp: null")]
    return []


def rule_zero_with_pp(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    if run is None or run.zero_stage < 2 or layout.pp == 1:
        return []
    return [Problem("error", "zero_with_pp", f"zero_stage={run.zero_stage} with pp={layout.pp} is unsupported: "
                    "pipeline parallelism runs many micro-batches and ZeRO-2/3 adds data-parallel traffic to each one "
                    "(DeepSpeed #1629)", "use zero_stage 1 (or 0) with pp > 1, or pp: 1 with ZeRO-2/3", (0, 1))]


def tp_spans_nodes(*, tp: int, gpus_per_node: int) -> bool:
    """megatron-core numbers ranks tp-fastest, so a TP group is tp consecutive ranks: inside one node exactly when
    tp divides gpus_per_node."""
    return gpus_per_node % tp != 0


def rule_tp_within_node(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    if run is None or run.device == "cpu" or not tp_spans_nodes(tp=layout.tp, gpus_per_node=run.gpus_per_node):
        return []
    in_node = tuple(t for t in valid_tp_sizes(model=model, limit=run.gpus_per_node) if run.gpus_per_node % t == 0)
    return [Problem("warning", "tp_crosses_nodes",
                    f"tp={layout.tp} with gpus_per_node={run.gpus_per_node}: a TP group spans nodes, and its "
                    "all-reduces (several per layer) cross the inter-node network",
                    f"use an in-node tp ({_listing(in_node)}; largest: {max(in_node, default=1)}) and pp across nodes",
                    in_node)]


def rule_sequence_split(*, layout: Layout, model: ModelFacts, run: RunFacts | None) -> list[Problem]:
    """Sequence parallelism splits each CP rank's s / cp tokens into tp equal slices."""
    if run is None or not layout.sp or layout.tp == 1 or run.seq_length % (layout.cp * layout.tp) == 0:
        return []
    multiple = math.lcm(layout.cp * layout.tp, 2 * layout.cp if layout.cp > 1 else 1)
    return [Problem("error", "sequence_parallel_vs_seq_length", f"seq_length={run.seq_length} is not divisible by "
                    f"cp×tp={layout.cp}×{layout.tp}: sequence parallelism splits each sequence into tp equal slices",
                    f"use a seq_length that is a multiple of {multiple}, or parallel.sequence_parallel: false")]


RULES: tuple[Rule, ...] = (rule_sizes, rule_world_size, rule_tensor_parallel, rule_pipeline, rule_context_parallel,
                           rule_attention_softcap, rule_local_layers_only,
                           rule_sequence_split, rule_expert_parallel, rule_moe_training, rule_batch,
                           rule_zero_with_pp, rule_tp_within_node)


def layout_problems(*, layout: Layout, model: ModelFacts, run: RunFacts | None = None) -> list[Problem]:
    """Every problem of `layout` for `model` (and, given `run`, for the world, batch and device it runs with)."""
    sizes = rule_sizes(layout=layout, model=model, run=run)
    if sizes:
        return sizes  # nothing else is computable
    return [problem for rule in RULES[1:] for problem in rule(layout=layout, model=model, run=run)]


def run_problems(*, layout: Layout, run: RunFacts) -> list[Problem]:
    """The rules that need no model: the world and the batch (a model without a megatron-core adapter)."""
    return [*rule_world_size(layout=layout, model=None, run=run), *rule_batch(layout=layout, model=None, run=run)]


def layout_errors(*, layout: Layout, model: ModelFacts, run: RunFacts | None = None) -> list[Problem]:
    return [p for p in layout_problems(layout=layout, model=model, run=run) if p.severity == "error"]


def require_valid_layout(*, layout: Layout, model: ModelFacts, run: RunFacts | None = None) -> None:
    """Raise LayoutError listing every error (the trainer and `dsmt verify`)."""
    from toolkit.parallel.groups import LayoutError

    errors = layout_errors(layout=layout, model=model, run=run)
    if errors:
        lines = [f"[{p.rule}] {p.message}" + (f"; fix: {p.fix}" if p.fix else "") for p in errors]
        raise LayoutError(f"layout {layout.parallel_label()} does not fit the model:\n  - " + "\n  - ".join(lines))
