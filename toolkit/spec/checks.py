"""Pre-flight checks across sections: each is a small named function returning problems; all are collected.

A check names the rule, the values it saw and the valid alternatives. Section-local rules (host names, ZeRO
offload, ...) are decided by the schema itself; these need the model shape or more than one section.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from toolkit.errors import DsmtError
from toolkit.generate.deepspeed_config import grad_accum_dtype
from toolkit.shapes import ModelShape, ModelShapeError
from toolkit.spec.layout import derive_layout, divisors, padded_vocab_size, requested_global_batch, world_size_of
from toolkit.spec.load import model_shape, read_spec_file, shape_problem, validate_spec, apply_overrides
from toolkit.spec.report import Problem, Report, SpecError
from toolkit.spec.schema import JobSpec

Check = Callable[..., list[Problem]]


def _listing(values) -> str:
    return ", ".join(str(v) for v in values) or "none"


def _tp_candidates(spec: JobSpec) -> list[int]:
    """TP sizes the cluster can host with the spec's pp (divisors of world / pp)."""
    world, pp = world_size_of(spec), spec.parallel.pp
    return divisors(world // pp if world % pp == 0 else world)


def check_world_size(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    world, tp, pp = world_size_of(spec), spec.parallel.tp, spec.parallel.pp
    if world % (tp * pp) == 0:
        return []
    valid_tp = [d for d in divisors(world) if (world // d) % pp == 0]
    return [Problem(
        "error", "world_size",
        f"world_size={world} (nodes={spec.cluster.nodes} × gpus_per_node={spec.cluster.gpus_per_node}) is not "
        f"divisible by tp×pp={tp}×{pp}={tp * pp}; dp would not be whole",
        f"valid tp with pp={pp}: {_listing(valid_tp)}",
    )]


def check_heads_vs_tp(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    tp, heads = spec.parallel.tp, shape.num_attention_heads
    if heads % tp == 0:
        return []
    return [Problem("error", "heads_vs_tp", f"tp={tp} does not divide num_attention_heads={heads}",
                    f"valid tp: {_listing(t for t in _tp_candidates(spec) if heads % t == 0)}")]


def check_kv_heads_vs_tp(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """KV heads are either split (kv % tp == 0) or replicated (tp % kv == 0); anything else cannot be laid out."""
    tp, kv = spec.parallel.tp, shape.num_kv_heads
    if kv % tp == 0 or tp % kv == 0:
        return []
    valid = [t for t in _tp_candidates(spec) if shape.num_attention_heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    return [Problem("error", "kv_heads_vs_tp",
                    f"tp={tp} neither divides nor is a multiple of num_kv_heads={kv}",
                    f"valid tp: {_listing(valid)}")]


def check_ffn_vs_tp(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    tp, ffn = spec.parallel.tp, shape.ffn_hidden_size
    if ffn % tp == 0:
        return []
    valid = [t for t in _tp_candidates(spec) if ffn % t == 0]
    return [Problem("error", "ffn_vs_tp", f"tp={tp} does not divide ffn_hidden_size={ffn}", f"valid tp: {_listing(valid)}")]


def check_layers_vs_pp(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    pp, vpp, layers = spec.parallel.pp, spec.parallel.vpp or 1, shape.num_layers
    if layers % (pp * vpp) == 0:
        return []
    valid_pp = [p for p in divisors(layers) if layers % (p * vpp) == 0 and p <= world_size_of(spec)]
    valid_vpp = [v for v in divisors(layers // pp)] if layers % pp == 0 else []
    fix = f"valid pp with vpp={vpp}: {_listing(valid_pp)}"
    if valid_vpp:
        fix += f"; valid vpp with pp={pp}: {_listing(valid_vpp)}"
    return [Problem("error", "layers_vs_pp",
                    f"num_layers={layers} is not divisible by pp×vpp={pp}×{vpp}={pp * vpp} (equal stages)", fix)]


def check_vocab_padding(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    multiple, tp = spec.model.make_vocab_size_divisible_by, spec.parallel.tp
    padded = padded_vocab_size(vocab_size=shape.vocab_size, divisible_by=multiple)
    if padded % tp:
        return [Problem("error", "vocab_padding",
                        f"the padded vocabulary {padded} (vocab_size={shape.vocab_size} rounded up to a multiple of "
                        f"make_vocab_size_divisible_by={multiple}) is not divisible by tp={tp}",
                        f"set model.make_vocab_size_divisible_by to a multiple of {tp} (e.g. {multiple * tp})")]
    if padded == shape.vocab_size:
        return []
    return [Problem("info", "vocab_padding",
                    f"vocab_size={shape.vocab_size} is padded to {padded} (a multiple of make_vocab_size_divisible_by="
                    f"{multiple}, the same for every tp so one checkpoint serves all layouts); "
                    f"the {padded - shape.vocab_size} extra rows are dropped on export")]


def check_batch_divisibility(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    world, tp, pp = world_size_of(spec), spec.parallel.tp, spec.parallel.pp
    if world % (tp * pp):
        return []  # reported by check_world_size
    dp, micro = world // (tp * pp), spec.training.micro_batch_size
    global_batch = requested_global_batch(spec, dp=dp)
    unit = micro * dp
    if global_batch % unit == 0:
        return []
    below, above = global_batch // unit * unit, (global_batch // unit + 1) * unit
    valid_micro = [m for m in divisors(global_batch // dp)] if global_batch % dp == 0 else []
    fix = f"nearest valid global_batch_size: {_listing(v for v in (below, above) if v)}"
    if valid_micro:
        fix += f"; or micro_batch_size in: {_listing(valid_micro)}"
    return [Problem("error", "batch_divisibility",
                    f"global_batch_size={global_batch} is not divisible by micro_batch_size×dp={micro}×{dp}={unit} "
                    f"(DeepSpeed requires train_batch_size = micro × grad_accum × dp)", fix)]


def check_zero_with_pp(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    if spec.parallel.zero_stage < 2 or spec.parallel.pp == 1:
        return []
    return [Problem("error", "zero_with_pp",
                    f"zero_stage={spec.parallel.zero_stage} with pp={spec.parallel.pp} is unsupported: pipeline "
                    "parallelism runs many micro-batches and ZeRO-2/3 adds data-parallel traffic to each one",
                    "use zero_stage=1 (or 0) with pp > 1, or pp=1 with ZeRO-2/3")]


def check_vpp_microbatches(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """Megatron-core's interleaved schedule runs micro-batches in groups of pp (microbatch_group_size_per_vp_stage
    defaults to pp, and dsmt leaves it there); a remainder group smaller than pp raises at the first step."""
    world, tp, pp, vpp = world_size_of(spec), spec.parallel.tp, spec.parallel.pp, spec.parallel.vpp or 1
    if vpp == 1 or world % (tp * pp):
        return []
    dp, micro = world // (tp * pp), spec.training.micro_batch_size
    num_microbatches = requested_global_batch(spec, dp=dp) // (micro * dp)
    if num_microbatches and num_microbatches % pp == 0:
        return []
    unit = pp * micro * dp
    return [Problem("error", "vpp_microbatches",
                    f"interleaved pipeline (vpp={vpp}) needs num_microbatches to be a multiple of pp={pp}; got "
                    f"{num_microbatches} (global_batch_size / (micro_batch_size×dp={micro}×{dp}))",
                    f"use a global_batch_size that is a multiple of pp×micro×dp={unit}, or set vpp=null")]


def check_tp_within_node(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    if spec.parallel.tp <= spec.cluster.gpus_per_node:
        return []
    return [Problem("warning", "tp_crosses_nodes",
                    f"tp={spec.parallel.tp} > gpus_per_node={spec.cluster.gpus_per_node}: tensor-parallel all-reduces "
                    "cross the inter-node network on every layer", f"keep tp <= {spec.cluster.gpus_per_node}; use pp across nodes")]


def check_precision_on_device(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    problems = []
    if spec.cluster.device == "cpu" and spec.training.precision == "fp16":
        problems.append(Problem("error", "fp16_on_cpu", "precision=fp16 with device=cpu: DeepSpeed refuses fp16 on CPU",
                                "use precision fp32 or bf16"))
    if spec.cluster.device == "cpu" and spec.parallel.sequence_parallel:
        problems.append(Problem("error", "sequence_parallel_on_cpu",
                                "sequence_parallel with device=cpu: megatron's torch-norm fallback refuses it",
                                "set parallel.sequence_parallel=false"))
    return problems


def check_mixed_precision(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """What DeepSpeed and megatron can do with 16-bit training at this layout (see deepspeed_config.py)."""
    precision, zero, pp = spec.training.precision, spec.parallel.zero_stage, spec.parallel.pp
    accum = grad_accum_dtype(spec=spec)  # what the generated DeepSpeed config will say
    problems = []
    if precision == "fp16" and pp > 1:
        # megatron's schedule scales the loss only through config.grad_scale_func, DeepSpeed's fp16 optimizer
        # unscales by its own loss scale: updates would be ~65,536x too small.
        problems.append(Problem("error", "fp16_with_pp",
                                f"precision=fp16 with pp={pp}: DeepSpeed's dynamic loss scale does not reach "
                                "megatron's pipeline schedule", "use precision: bf16 (no loss scaling needed), or pp: 1"))
    if precision != "fp32" and accum not in ("fp32", precision):
        problems.append(Problem("error", "grad_accum_dtype",
                                f"communication.grad_accum_dtype={accum} with precision={precision}",
                                f"use fp32 (the default) or {precision}"))
    if precision != "fp32" and zero == 0 and accum == "fp32":
        problems.append(Problem("error", "fp32_accumulation_needs_zero",
                                f"precision={precision} with zero_stage=0: DeepSpeed has no fp32 gradient accumulation "
                                "(nor fp32 master weights) without ZeRO",
                                f"use zero_stage: 1 (same memory as 0 at dp=1), or communication.grad_accum_dtype: "
                                f"{precision} to accept 16-bit accumulation"))
    return problems


def check_hosts_for_multi_node(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    hosts = spec.cluster.hosts
    loopback = {"localhost", "127.0.0.1"}
    if spec.cluster.nodes > 1 and isinstance(hosts, list) and loopback & set(hosts):
        return [Problem("error", "loopback_multi_node", f"nodes={spec.cluster.nodes} but hosts include a loopback name: {hosts}",
                        "list each node's reachable host name")]
    if spec.cluster.nodes > 1 and spec.cluster.master_addr in loopback:
        return [Problem("error", "loopback_multi_node", f"master_addr={spec.cluster.master_addr} with nodes={spec.cluster.nodes}",
                        "use the first node's reachable address, or leave master_addr unset")]
    return []


def check_lengths_and_intervals(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    problems = []
    seq, max_pos = spec.training.seq_length, shape.max_position_embeddings
    if seq > max_pos:
        problems.append(Problem("warning", "seq_length_vs_positions",
                                f"seq_length={seq} exceeds the model's max_position_embeddings={max_pos}",
                                f"use seq_length <= {max_pos} unless the model's RoPE scaling allows more"))
    if spec.training.checkpoint_interval > spec.training.train_steps:
        problems.append(Problem("warning", "no_checkpoint",
                                f"checkpoint_interval={spec.training.checkpoint_interval} > train_steps="
                                f"{spec.training.train_steps}: only the final checkpoint is written", ""))
    return problems


DATA_SOURCE_FIX = ("set data.path to a jsonl/json/csv/parquet/text file or a save_to_disk directory, or "
                   "data.synthetic: true for synthetic tokens (benchmarks, smoke tests)")


def check_data(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    path = spec.data.path
    if spec.data.synthetic:
        return [Problem("info", "synthetic_data", "data.synthetic=true: training uses synthetic tokens")]
    if path is None:  # training on made-up tokens must be asked for, never a silent fallback
        return [Problem("error", "data_source", "data.path is unset and data.synthetic=false: there is no data to "
                        "train on", DATA_SOURCE_FIX)]
    if not Path(path).expanduser().exists():
        return [Problem("warning", "data_path_missing", f"data.path={path} does not exist on this machine",
                        "fine if it exists on the cluster; otherwise fix the path")]
    return []


def check_builtin_tokenizer(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """A built-in shape has no tokenizer files: text data needs data.tokenizer (whose size `dsmt train --dry-run`
    checks against vocab_size; loading it here would make `dsmt check` slow)."""
    data = spec.data
    if spec.model.builtin is None or data.tokenizer is not None or data.path is None or data.synthetic:
        return []
    return [Problem("error", "builtin_needs_tokenizer",
                    f"model.builtin={spec.model.builtin} is a shape without tokenizer files, and data.path={data.path} "
                    "is text to tokenise, but data.tokenizer is unset",
                    f"set data.tokenizer to a tokenizer directory whose vocabulary fits vocab_size={shape.vocab_size} "
                    "(the model family's own), or data.synthetic: true with no data.path")]


def _planner_inputs(spec: JobSpec):
    """The spec as the planner's (Layout, TrainingShape, GpuSpec, Assumptions); raises DsmtError if not whole."""
    from toolkit.plan.assumptions import Assumptions
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Layout as PlanLayout, TrainingShape

    layout, parallel, comm = derive_layout(spec), spec.parallel, spec.communication
    plan_layout = PlanLayout(
        tp=layout.tp, pp=layout.pp, dp=layout.dp, vpp=layout.vpp, zero_stage=parallel.zero_stage,
        micro_batch_size=layout.micro_batch_size, recompute=spec.training.recompute,
        sequence_parallel=parallel.sequence_parallel, offload_optimizer=parallel.offload_optimizer)
    training = TrainingShape(seq_length=layout.seq_length, global_batch_size=layout.global_batch_size)
    assumptions = Assumptions(reduce_bucket_elements=comm.reduce_bucket_elements,
                              zero3_prefetch_elements=comm.prefetch_bucket_elements)
    if spec.training.precision == "fp32":  # fp32 weights, grads, activations; Adam needs no separate master copy
        assumptions = dataclasses.replace(assumptions, param_bytes=4, grad_bytes=4, master_grad_bytes=0,
                                          optimizer_bytes_per_param=8, activation_bytes=4)
    return plan_layout, training, get_gpu(spec.cluster.gpu), assumptions


def _memory_fixes(spec: JobSpec, *, global_batch_size: int) -> str:
    """The knobs that lower per-GPU memory, skipping the ones the spec already turned all the way."""
    parallel, training, cluster = spec.parallel, spec.training, spec.cluster
    fixes = []
    if parallel.zero_stage < (1 if parallel.pp > 1 else 3):  # ZeRO-2/3 are refused with pp > 1
        fixes.append(f"parallel.zero_stage={1 if parallel.pp > 1 else 3}")
    if training.recompute != "full":
        fixes.append("training.recompute=full")
    fixes.append("a larger parallel.tp or parallel.pp")
    if training.micro_batch_size > 1:
        fixes.append(f"training.micro_batch_size={training.micro_batch_size // 2}")
    model = spec.model.builtin or spec.model.path or "<model>"
    fixes.append(f"`dsmt plan {model} --nodes {cluster.nodes} --gpus-per-node {cluster.gpus_per_node} --gpu "
                 f"{cluster.gpu} --seq-len {training.seq_length} --global-batch {global_batch_size}` for layouts that fit")
    return "; or ".join(fixes)


def check_memory_fit(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """The planner's per-GPU memory estimate (worst pipeline stage) against the GPU's capacity."""
    if spec.cluster.device == "cpu":
        return [Problem("info", "memory_fit", "memory fit: not modelled for CPU runs")]
    from toolkit.plan.memory import estimate_memory  # imported here: the planner is not needed for CPU specs

    try:
        layout, training, gpu, assumptions = _planner_inputs(spec)
        memory = estimate_memory(shape=shape, layout=layout, training=training, gpu=gpu, assumptions=assumptions)
    except DsmtError:  # a layout that is not whole (world, batch, layers); the checks above say why
        return [Problem("info", "memory_fit", "memory fit: not estimated, the layout above is invalid")]
    total_gb, capacity_gb = memory.total_bytes / 1e9, memory.capacity_bytes / 1e9
    if memory.fits:
        return [Problem("info", "memory_fit", f"memory fit: predicted {total_gb:.1f} GB per GPU of "
                        f"{capacity_gb:.1f} GB ({gpu.name}, worst pipeline stage {memory.worst.stage})")]
    parts = ", ".join(f"{name} {value / 1e9:.1f}" for name, value in memory.by_category().items())
    return [Problem("error", "memory_fit",
                    f"predicted {total_gb:.1f} GB per GPU on pipeline stage {memory.worst.stage} ({parts} GB) "
                    f"exceeds the {capacity_gb:.1f} GB of one {gpu.name} ({layout.label()})",
                    _memory_fixes(spec, global_batch_size=training.global_batch_size))]


CHECKS: tuple[Check, ...] = (
    check_world_size, check_heads_vs_tp, check_kv_heads_vs_tp, check_ffn_vs_tp, check_layers_vs_pp,
    check_vocab_padding, check_batch_divisibility, check_zero_with_pp, check_vpp_microbatches,
    check_tp_within_node, check_precision_on_device, check_mixed_precision, check_hosts_for_multi_node, check_lengths_and_intervals,
    check_data, check_builtin_tokenizer, check_memory_fit,
)


def _model_type_of(spec: JobSpec) -> str | None:
    """model_type of an HF checkpoint directory in model.path (None when there is none to read)."""
    import json

    if spec.model.path is None or not (Path(spec.model.path) / "config.json").is_file():
        return None
    try:
        return json.loads((Path(spec.model.path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def plain_model_problems(*, spec: JobSpec) -> list[Problem] | None:
    """Checks for an HF model that is not a transformer LM (e.g. ResNet): it trains with DeepSpeed data
    parallelism only, so only tp = pp = 1 and the batch arithmetic apply. None when model.path is no such model."""
    model_type = _model_type_of(spec)
    if model_type is None:
        return None
    problems = [Problem("info", "plain_model", f"model_type {model_type}: not a transformer LM shape; it trains with "
                                               "DeepSpeed ZeRO data parallelism only (tp=1, pp=1)")]
    if spec.parallel.tp > 1 or spec.parallel.pp > 1:
        problems.append(Problem("error", "plain_model_layout",
                                f"tp={spec.parallel.tp}, pp={spec.parallel.pp}: model_type {model_type} has no "
                                "megatron-core adapter", "set parallel.tp=1 and parallel.pp=1"))
    problems += check_batch_divisibility(spec=spec, shape=None)
    problems += check_plain_model_data(spec=spec, model_type=model_type)
    return problems


def check_plain_model_data(*, spec: JobSpec, model_type: str) -> list[Problem]:
    """A model without an adapter has no tokenised-data path: it trains on synthetic inputs, asked for by name."""
    if spec.data.synthetic:
        return []
    return [Problem("error", "data_source", f"model_type {model_type} has no megatron-core adapter and trains on "
                    f"synthetic inputs only, but data.synthetic=false (data.path={spec.data.path!r})",
                    "set data.synthetic: true and leave data.path unset")]


def run_checks(*, spec: JobSpec, source: str = "job spec") -> Report:
    """Every cross-section problem of a validated spec, in one report."""
    try:
        shape = model_shape(spec.model)
    except ModelShapeError as err:
        plain = plain_model_problems(spec=spec)
        return Report(source=source, problems=tuple(plain) if plain is not None else (shape_problem(err),))
    problems: list[Problem] = []
    for check in CHECKS:
        problems.extend(check(spec=spec, shape=shape))
    return Report(source=source, problems=tuple(problems))


def check_file(path: str | Path, *, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobSpec | None, Report]:
    """Load, validate and check `path`: (spec or None when it does not validate, the report)."""
    raw = apply_overrides(read_spec_file(path), overrides=overrides)
    try:
        spec = validate_spec(raw, source=str(path))
    except SpecError as err:
        return None, err.report
    return spec, run_checks(spec=spec, source=str(path))
