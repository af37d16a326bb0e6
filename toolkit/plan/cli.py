"""`dsmt plan`: rank the parallel layouts of a model on a cluster by predicted step time among those that fit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from toolkit.errors import DsmtError

OVERRIDES = {  # flag -> (Assumptions field, help); defaults and sources: toolkit/plan/assumptions.py
    "--efficiency": ("efficiency", "achieved / peak matmul throughput (default: the GPU's fit to published runs, "
                                   "A100 0.70, H100 0.52; dsmt plan --calibration)"),
    "--link-efficiency": ("link_efficiency", "achieved / nominal link bandwidth (default 0.8)"),
    "--dp-overlap": ("dp_overlap", "share of ZeRO-2/3 traffic hidden behind compute at pp = 1 (default 0.1, fitted "
                                   "to DeepSpeed's ZeRO-3 runs; other layouts hide none)"),
    "--deepspeed-latency-scale": ("deepspeed_latency_scale", "DeepSpeed data-parallel collective latency as a "
                                                             "multiple of NCCL's model (default 3.5, fitted)"),
    "--tp-overlap": ("tp_overlap", "share of tensor-parallel communication hidden (default 0)"),
    "--cp-overlap": ("cp_overlap", "share of the context-parallel ring exchange hidden behind attention (default 0.9)"),
    "--time-uncertainty": ("time_uncertainty", "relative uncertainty of a predicted step: within it of the fastest, "
                                               "the simplest layout is chosen (default 0.06; 0 = fastest only)"),
    "--dp-grad-comm-bytes": ("dp_grad_comm_bytes", "bytes per gradient element reduced over data parallelism "
                                                   "(default 4: communication_data_type fp32)"),
    "--elementwise-backward-factor": ("elementwise_backward_factor", "memory-bound bytes of backward / forward "
                                                                     "(default 2)"),
    "--collective-latency-s": ("collective_latency_s", "base latency of one collective call (default 8.4e-6, NCCL's "
                                                       "model; plus 3.4e-6 per NVLink and 9.6e-6 per network step)"),
    "--optimizer-passes": ("optimizer_passes", "HBM passes over the optimizer state per step (default 3)"),
    "--router-imbalance": ("router_imbalance", "MoE: routed tokens of the busiest expert-parallel rank over the mean "
                                               "(default 1.0 = balanced routing; capped at ep)"),
    "--cpu-adam-params-per-s": ("cpu_adam_params_per_s", "CPU Adam update rate with offload (default 1e9)"),
    "--pcie-gbps": ("pcie_gbps", "host <-> GPU bandwidth with offload, GB/s (default 25)"),
    "--overhead-gb": ("framework_overhead_gb", "per-GPU allowance for CUDA context, NCCL, workspaces (default 2.5)"),
    "--fragmentation": ("fragmentation_fraction", "allocator slack as a share of the rest (default 0.05)"),
    "--checkpoint-write-gbps": ("checkpoint_write_gbps", "GB/s one node writes to the checkpoint filesystem, for "
                                                         "the predicted save time (default 2, an assumption)"),
    "--adam-bytes": ("optimizer_bytes_per_param", "optimizer bytes per parameter, the ZeRO paper's K (default 12)"),
    "--master-grad-bytes": ("master_grad_bytes", "fp32 gradient copy bytes per parameter (default 4; 0 = paper)"),
}
SHARES = ("efficiency", "link_efficiency", "dp_overlap", "tp_overlap", "cp_overlap", "time_uncertainty")
GPU_FLAGS = ("gpu_mem_gb", "peak_tflops", "nvlink_gbps", "ib_gbps", "hbm_gbps")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="pick TP / PP / VPP / DP / ZeRO / micro-batch / recompute for a cluster",
                              description=__doc__)
    p.add_argument("model", nargs="?", help="built-in shape name (e.g. llama3-70b), HF checkpoint dir, or config.json; also "
                   "the models of the published runs the planner is calibrated on (e.g. gpt-18.4b, gpt-neox-20b)")
    p.add_argument("--calibration", action="store_true", help="print the published runs the time model is "
                   "calibrated on, measured against predicted, and exit")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb", help="preset (a100-40gb, a100-80gb, h100-80gb, h200-141gb) or "
                   "'custom' with the --gpu-mem-gb / --peak-tflops / --nvlink-gbps / --ib-gbps figures")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (with --dpo: preference pairs)")
    p.add_argument("--top", type=int, default=10, help="how many fitting layouts to print")
    p.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    p.add_argument("--emit-spec", type=Path, metavar="JOB.yaml", help="write the best layout as a job spec")
    p.add_argument("--explain", metavar="LAYOUT", help='why a layout fits or not, e.g. "tp=8 pp=4 zero=1 mbs=1"')
    p.add_argument("--charts", type=Path, metavar="DIR", help="draw memory.{png,svg} and pipeline.{png,svg}")
    limits = p.add_argument_group("search limits", "restrict the layouts searched, to ask the question a run "
                                  "answered (e.g. a replicated optimizer: --zero-stages 0)")
    limits.add_argument("--zero-stages", metavar="LIST", default="1,2,3",
                        help="ZeRO stages to search, comma-separated (default 1,2,3; 0 = replicated optimizer)")
    limits.add_argument("--max-tp", type=int, metavar="N", help="largest tensor-parallel size searched")
    limits.add_argument("--max-pp", type=int, metavar="N", help="largest pipeline-parallel size searched")
    limits.add_argument("--recompute", metavar="LIST", default="none,selective,full",
                        help="activation recompute choices searched, comma-separated (default all)")
    offload = limits.add_mutually_exclusive_group()
    offload.add_argument("--allow-offload", action="store_true", help="also consider ZeRO-Offload of the optimizer")
    offload.add_argument("--no-offload", action="store_true",
                         help="never offload the optimizer (the default; stated for scripts that say it)")
    limits.add_argument("--max-mbs", type=int, default=16, help="largest micro-batch size searched")
    p.add_argument("--attention", choices=("fused", "local"), default="fused",
                   help="fused: Transformer Engine / flash (no s x s scores stored, needed for cp > 1); local: "
                        "megatron's unfused attention (stores the s x s scores; what runs without TE)")
    p.add_argument("--dropout", action="store_true", help="count dropout masks (GPT-style models)")
    p.add_argument("--lora-rank", type=int, metavar="R", help="LoRA fine-tuning with adapters of rank R on what "
                   "dsmt adapts by default (attention, MLP, routed and shared experts): optimizer state for the "
                   "adapters only (toolkit/plan/lora.py)")
    p.add_argument("--dpo", metavar="REFERENCE", help="preference tuning (training.method: dpo) against a reference: "
                   "base (full fine-tuning: a frozen copy of the weights; with --lora-rank the adapters switched "
                   "off), precomputed (log-probs from disk), or a checkpoint path (a frozen copy); --global-batch "
                   "counts pairs (toolkit/plan/dpo.py)")
    p.add_argument("--dpo-unpacked", action="store_true", help="with --dpo: data.packing false, each side of a pair "
                   "its own row of --seq-len (default: both sides in one row)")
    for flag in ("--gpu-mem-gb", "--peak-tflops", "--nvlink-gbps", "--ib-gbps", "--hbm-gbps"):
        p.add_argument(flag, type=float, help="override the GPU preset's figure (GB, TFLOPS, GB/s per direction)")
    for flag, (_, text) in OVERRIDES.items():
        p.add_argument(flag, type=float, help=text)
    p.set_defaults(func=run)


def _assumptions(args):
    from toolkit.plan.assumptions import Assumptions

    values = {}
    for flag, (field, _) in OVERRIDES.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            if value < 0 or (field in SHARES and value > 1) or (field in ("efficiency", "link_efficiency")
                                                                and value == 0):
                raise DsmtError(f"{flag}={value} is out of range; efficiencies are in (0, 1], overlaps and the "
                                "time uncertainty in [0, 1], the rest >= 0")
            kind = float if field == "efficiency" else type(getattr(Assumptions, field))  # efficiency: None = GPU's
            values[field] = kind(value)
    values["attention"] = args.attention  # the layers follow it (adapters/build.py layer_spec)
    values["layer_spec"] = "te" if args.attention == "fused" else "local"
    if args.dropout:
        values["dropout"] = True
    return dataclasses.replace(Assumptions(), **values)


def _calibration(args) -> int:
    """`dsmt plan --calibration`: every published measured run against the model's prediction. Each run is timed
    on its own cluster and setup (its attention, dropout, gradient width, engine), so only the time model's
    other assumption flags apply; a question's flags are refused."""
    from toolkit.plan.calibration import calibration_rows, calibration_table

    question = [flag for flag, value in (("MODEL", args.model), ("--nodes", args.nodes), ("--seq-len", args.seq_len),
                                         ("--global-batch", args.global_batch), ("--explain", args.explain),
                                         ("--emit-spec", args.emit_spec), ("--charts", args.charts),
                                         ("--lora-rank", args.lora_rank), ("--dpo", args.dpo)) if value is not None]
    if question:
        raise DsmtError(f"--calibration prints the published runs on their own clusters; it takes no question "
                        f"({', '.join(question)}): drop those, or drop --calibration to plan")
    assumptions = _assumptions(args)
    if args.json:
        json.dump(calibration_rows(assumptions), sys.stdout, indent=2)
        print()
    else:
        print("\n".join(calibration_table(assumptions)))
    return 0


def _model_shape(ref: str, load_model_shape):
    """A checkpoint path or built-in shape (load_model_shape), or a published run's model (published.PAPER_SHAPES,
    e.g. gpt-18.4b) where no such path exists."""
    from toolkit.plan.published import PAPER_SHAPES

    if ref in PAPER_SHAPES and not Path(ref).exists():
        return PAPER_SHAPES[ref]
    return load_model_shape(ref)


def _limits(args):
    from toolkit.plan.search import SearchLimits

    try:
        zero_stages = tuple(sorted({int(z) for z in args.zero_stages.split(",") if z.strip()}))
    except ValueError:
        raise DsmtError(f"--zero-stages={args.zero_stages!r} must list stages as integers, e.g. --zero-stages 0,1")
    recompute = tuple(r.strip() for r in args.recompute.split(",") if r.strip())
    return SearchLimits(zero_stages=zero_stages, max_tp=args.max_tp, max_pp=args.max_pp, recompute=recompute,
                        offload=args.allow_offload, max_micro_batch_size=args.max_mbs)


def _lora(args, shape):
    """--lora-rank: adapters on what dsmt's LoRA adapts with training.lora.targets unset (toolkit/plan/lora.py
    `default_projections`): attention (multi-latent attention's too), routed experts, and the dense MLP and shared
    experts unless PEFT reads their names as the experts of the checkpoint's model type. A built-in shape (no model
    type) is planned with every projection it has."""
    from toolkit.plan.lora import LoraShape, default_projections

    if args.lora_rank is None:
        return None
    if args.lora_rank < 1:
        raise DsmtError(f"--lora-rank={args.lora_rank} must be at least 1 (typical: 8 to 64)")
    redirected = shape.is_moe and _peft_redirects_mlp(args.model)
    return LoraShape(rank=args.lora_rank, projections=default_projections(shape, mlp_names_redirected=redirected))


def _peft_redirects_mlp(ref: str) -> bool:
    """Whether PEFT on transformers 5 reads the MLP names (gate_proj / up_proj / down_proj; Mixtral's w1 / w2 / w3)
    of the checkpoint's model type as its fused routed experts (toolkit/adapters/peft_names.py). False for a
    built-in or published shape (no model type)."""
    from toolkit.adapters.peft_names import peft_redirected_names
    from toolkit.models.shapes import read_model_ref

    if not Path(ref).exists():
        return False
    read = read_model_ref(ref)
    model_type = read.get("model_type") if isinstance(read, dict) else None
    return bool(peft_redirected_names(model_type) - {"gate"})


def _dpo(args):
    """--dpo / --dpo-unpacked as the plan's DpoShape; None without --dpo."""
    from toolkit.plan.dpo import DpoShape

    if args.dpo is None:
        if args.dpo_unpacked:
            raise DsmtError("--dpo-unpacked describes DPO's pairs: give --dpo REFERENCE (base, precomputed or a "
                            "checkpoint path) with it, or drop it")
        return None
    if not args.dpo.strip() or args.dpo == "none":  # "none" is the planner's SimPO / ORPO, not a spec's reference
        raise DsmtError("--dpo needs a reference: base, precomputed, or a checkpoint path (SimPO and ORPO hold "
                        "none: plan them as --dpo precomputed, which counts their pairs and no reference)")
    return DpoShape(reference=args.dpo, packing=not args.dpo_unpacked)


def _cluster(args):
    from toolkit.plan.hardware import custom_gpu, get_gpu
    from toolkit.plan.layout import Cluster

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise DsmtError(f"--nodes ({args.nodes}) and --gpus-per-node ({args.gpus_per_node}) must be >= 1")
    figures = {k: getattr(args, k) for k in GPU_FLAGS}
    base = None if args.gpu.lower() == "custom" else get_gpu(args.gpu)
    gpu = base if base is not None and all(v is None for v in figures.values()) else custom_gpu(
        base=base, memory_gb=figures["gpu_mem_gb"], peak_tflops=figures["peak_tflops"],
        nvlink_gbps=figures["nvlink_gbps"], ib_gbps=figures["ib_gbps"], hbm_gbps=figures["hbm_gbps"])
    return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=gpu)


def run(args: argparse.Namespace) -> int:
    from toolkit.plan import report
    from toolkit.plan.layout import TrainingShape
    from toolkit.plan.search import plan
    from toolkit.adapters.model_shape import load_model_shape

    if args.calibration:
        return _calibration(args)
    missing = [flag for flag, value in (("MODEL", args.model), ("--nodes", args.nodes), ("--seq-len", args.seq_len),
                                        ("--global-batch", args.global_batch)) if value is None]
    if missing:
        raise DsmtError(f"dsmt plan needs {', '.join(missing)} (or --calibration alone), e.g. dsmt plan llama3-70b "
                        "--nodes 8 --seq-len 4096 --global-batch 128")
    shape = _model_shape(args.model, load_model_shape)
    cluster = _cluster(args)
    training = TrainingShape(seq_length=args.seq_len, global_batch_size=args.global_batch,
                             lora=_lora(args, shape), dpo=_dpo(args))
    if shape.attention_softcap is not None and args.attention == "fused":
        print(f"note: attn_logit_softcapping={shape.attention_softcap}: Transformer Engine's attention has no softcap, "
              "so the run uses megatron's local attention (training.attention: local); planned with it (the s x s "
              "scores stored)", file=sys.stderr)
        args.attention = "local"
    if shape.local_layers_only and args.attention == "fused":
        print(f"note: {shape.local_layers_only}: dsmt builds them on megatron's local layers only "
              "(training.attention: local); planned with them (the s x s scores stored)", file=sys.stderr)
        args.attention = "local"
    result = plan(shape=shape, training=training, cluster=cluster, assumptions=_assumptions(args),
                  limits=_limits(args))
    if args.explain:
        layout = report.parse_layout(args.explain, cluster=cluster)
        print(report.explain(shape=shape, layout=layout, training=training, cluster=cluster, result=result))
        return 0
    if args.json:
        json.dump(report.plan_dict(result, top=args.top), sys.stdout, indent=2)
        print()
    else:
        print(report.format_table(result, top=args.top))
    sys.stdout.flush()  # the table before any note on stderr
    if result.best is None:
        if args.emit_spec or args.charts:
            print("dsmt plan: no layout fits, so no spec or chart was written", file=sys.stderr)
        return 1
    if args.emit_spec and not _emit_spec(args=args, result=result, shape=shape, cluster=cluster, training=training):
        return 1
    if args.charts:
        from toolkit.plan.charts import draw_charts

        paths = draw_charts(result=result, candidate=result.best, out_dir=args.charts)
        print("charts: " + ", ".join(map(str, paths)), file=sys.stderr)
    return 0


def _emit_spec(*, args, result, shape, cluster, training) -> bool:
    """Write the fastest fitting layout as a job spec `dsmt train` runs as is; False when none fits."""
    from toolkit.errors import DsmtError
    from toolkit.plan import report
    from toolkit.plan.hardware import GPU_PRESETS

    if cluster.gpu.name not in GPU_PRESETS:  # "<preset>*" or "custom": a spec names a preset, which check fits to
        raise DsmtError(f"--emit-spec needs a GPU preset, but the plan used {cluster.gpu.name!r} (figures given on the "
                        "command line); a job spec names one of the presets "
                        f"({', '.join(GPU_PRESETS)}) and `dsmt check` fits the memory to it: drop the GPU figure "
                        "flags to emit a spec, or plan without --emit-spec")
    best = result.best
    if best is None:
        print("dsmt plan: no layout fits, so no spec was written", file=sys.stderr)
        return False
    spec = report.spec_dict(model_ref=args.model, candidate=best, cluster=cluster, training=training,
                            attention=result.assumptions.attention)
    if cluster.nodes > 1:  # a spec needs its hosts; under SLURM they come from the allocation (edit otherwise)
        spec["cluster"]["hosts"] = "slurm"
    # synthetic tokens until data.path (and, for a built-in shape, data.tokenizer) are set: a spec that runs as is.
    # DPO trains on preference records only: a placeholder path to replace, with the pairs' layout the plan counted
    spec["data"] = ({"synthetic": True} if training.dpo is None else
                    {"path": "data/preference.jsonl", "type": "preference", "packing": training.dpo.packing})
    if training.dpo is not None:
        print(f"note: set data.path in {args.emit_spec} to your preference records (prompt, chosen, rejected)",
              file=sys.stderr)
    report.write_spec_atomic(path=args.emit_spec, spec=spec)
    print(f"wrote {args.emit_spec} ({best.layout.label()})", file=sys.stderr)
    return True
