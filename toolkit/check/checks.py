"""Pre-flight checks across sections: each is a small named function returning problems; all are collected.

A check names the rule, the values it saw and the valid alternatives. Section-local rules (host names, ZeRO
offload, ...) are decided by the schema itself; these need the model shape or more than one section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from toolkit.errors import DsmtError, Problem, Report, SpecError
from toolkit.generate.deepspeed_config import grad_accum_dtype
from toolkit.models.shapes import ModelShape, ModelShapeError
from toolkit.parallel.rules import ModelFacts, RunFacts, layout_problems, run_problems
from toolkit.spec.layout import (derive_layout, padded_vocab_size, parallel_layout, requested_global_batch,
                                 spec_attention, spec_model_type, world_size_of)
from toolkit.check.data_checks import (ELSEWHERE, check_data, megatron_rows_only_problems,
                                      validation_record_problems)
from toolkit.spec.loopback import loopback_problems
from toolkit.check.model_checks import (check_model_adapter, check_model_family, check_model_files,
                                       no_adapter_problems)
from toolkit.spec.load import model_shape, read_spec, shape_problem, validate_spec
from toolkit.check.lora_checks import check_lora, spec_lora_modules
from toolkit.check.plain_checks import check_plain_model_data
from toolkit.check.preference_checks import check_preference, encoder_dpo_problems, plain_dpo_problems
from toolkit.spec.schema import JobSpec

Check = Callable[..., list[Problem]]


def spec_run_facts(spec: JobSpec) -> RunFacts:
    world, parallel = world_size_of(spec), parallel_layout(spec)
    return RunFacts(world_size=world, gpus_per_node=spec.cluster.gpus_per_node,
                    global_batch_size=requested_global_batch(spec, dp=parallel.dp),
                    micro_batch_size=spec.training.micro_batch_size, seq_length=spec.training.seq_length,
                    zero_stage=spec.parallel.zero_stage, device=spec.cluster.device,
                    attention=spec_attention(spec))


def check_layout(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """The one layout rule set (toolkit/parallel/rules.py), as plan, train and verify apply it."""
    model = ModelFacts.from_shape(shape, vocab_multiple=spec.model.make_vocab_size_divisible_by)
    return layout_problems(layout=parallel_layout(spec), model=model, run=spec_run_facts(spec))


def check_vocab_padding(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """How the vocabulary is padded (whether tp divides it is a layout rule)."""
    multiple = spec.model.make_vocab_size_divisible_by
    padded = padded_vocab_size(vocab_size=shape.vocab_size, divisible_by=multiple)
    if padded == shape.vocab_size:
        return []
    return [Problem("info", "vocab_padding",
                    f"vocab_size={shape.vocab_size} is padded to {padded} (a multiple of make_vocab_size_divisible_by="
                    f"{multiple}, the same for every tp so one checkpoint serves all layouts); "
                    f"the {padded - shape.vocab_size} extra rows are dropped on export")]


def check_precision_on_device(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    problems = []
    if spec.cluster.device == "cpu" and spec.training.precision == "fp16":
        problems.append(Problem("error", "fp16_on_cpu", "precision=fp16 with device=cpu: DeepSpeed refuses fp16 on CPU",
                                "use precision fp32 or bf16"))
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
    """Loopback hosts with nodes > 1 (toolkit/spec/loopback.py): distinct 127.x addresses simulate nodes (a warning)."""
    hosts = spec.cluster.hosts if isinstance(spec.cluster.hosts, list) else None
    return loopback_problems(nodes=spec.cluster.nodes, hosts=hosts, master_addr=spec.cluster.master_addr)


def check_lengths_and_intervals(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    problems = []
    seq, max_pos = spec.training.seq_length, shape.max_position_embeddings
    if seq > max_pos:
        problems.append(Problem("warning", "seq_length_vs_positions",
                                f"seq_length={seq} exceeds the model's max_position_embeddings={max_pos}",
                                f"use seq_length <= {max_pos} unless the model's RoPE scaling allows more"))
    interval, steps = spec.training.checkpoint_interval, spec.training.train_steps
    if interval > steps:  # not a warning: the last step is always saved (toolkit/train/job/loop.py train_steps)
        problems.append(Problem("info", "no_checkpoint", f"checkpoint_interval={interval} > train_steps={steps}: one "
                                f"checkpoint, at the end of the run (step {steps}); a run stopped before then "
                                "starts again from step 0"))
    return problems


def check_export_hf_interval(*, spec: JobSpec, shape: ModelShape | None) -> list[Problem]:
    """A checkpoint's hf/ is written while that checkpoint is saved (toolkit/train/job/loop.py `_save`): an
    export_hf_interval that checkpoint_interval does not divide would skip the steps it names between saves."""
    export, interval = spec.training.export_hf_interval, spec.training.checkpoint_interval
    if export is None or export % interval == 0:
        return []
    below, above = (export // interval) * interval, (export // interval + 1) * interval
    multiples = f"{below} or {above}" if below else f"{above}"
    return [Problem("error", "export_hf_interval_not_a_checkpoint",
                    f"training.export_hf_interval={export} is not a multiple of training.checkpoint_interval="
                    f"{interval}: hf/ is written into the checkpoint of its step, and only every {interval}th step "
                    "(and the last) is saved", f"set training.export_hf_interval to a multiple of {interval} "
                    f"({multiples}), or training.checkpoint_interval to a divisor of {export}")]


def check_validation_data(*, spec: JobSpec, shape: ModelShape, skip_records: str | None = None) -> list[Problem]:
    """data.validation_path present and its records readable as data.path's; validation needs real records. The
    held-out share's record counts need the records: `dsmt train --dry-run`. `skip_records`: as for check_data."""
    data = spec.data
    if data.validation_path is None and data.validation_fraction is None:
        return []
    if data.synthetic:
        return [Problem("error", "validation_synthetic", "data.synthetic=true has no records to validate on, but "
                        "data.validation_path / validation_fraction is set",
                        "unset data.validation_path and data.validation_fraction, or train on data.path")]
    path = data.validation_path
    if path is None:
        return []
    if Path(path).expanduser().exists():  # plain models (shape None): their task's checks read the records
        formats = shape is not None and not data.is_megatron and skip_records is None
        return validation_record_problems(data=data) if formats else []
    return [Problem("error", "validation_path_missing", f"data.validation_path={path} does not exist on this machine",
                    "give a file of the same kind and fields as data.path, or data.validation_fraction to hold out "
                    f"a share of data.path; {ELSEWHERE}")]


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


def planner_inputs(spec: JobSpec):
    """The spec as the planner's (PlanLayout, TrainingShape, GpuSpec, Assumptions); raises DsmtError if not whole.
    The assumptions carry the spec's precision (which DeepSpeed buffers exist), attention kernel and buffer sizes.
    A CPU spec has no GPU preset (gpu: cpu): its GpuSpec is None, the per-rank figures are still those of a GPU."""
    from toolkit.plan.assumptions import Assumptions
    from toolkit.plan.dpo import dpo_shape_of
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import PlanLayout, TrainingShape

    layout, parallel, comm = derive_layout(spec), spec.parallel, spec.communication
    plan_layout = PlanLayout(**layout.parallel_fields(), zero_stage=parallel.zero_stage,
                             micro_batch_size=layout.micro_batch_size, recompute=spec.training.recompute,
                             offload_optimizer=parallel.offload_optimizer)
    training = TrainingShape(seq_length=layout.seq_length, global_batch_size=layout.global_batch_size,
                             lora=_lora_shape(spec), dpo=dpo_shape_of(spec))
    device = spec.cluster.device
    attention = spec_attention(spec)
    assumptions = Assumptions.for_precision(
        spec.training.precision, reduce_bucket_elements=comm.reduce_bucket_elements,
        # the DP reduction width DeepSpeed uses (communication_data_type; dsmt's default fp32)
        dp_grad_comm_bytes={"bf16": 2, "fp16": 2}.get(comm.communication_data_type or "fp32", 4),
        overlap_comm=comm.overlap_comm and parallel.pp == 1,  # what the engine runs (engine_config)
        zero3_prefetch_elements=comm.prefetch_bucket_elements,
        zero3_persistence_threshold=comm.param_persistence_threshold_elements,
        # the layers follow the attention kind (adapters/build.py layer_spec): fused = Transformer Engine's
        attention=attention, layer_spec="te" if attention == "fused" else "local")
    gpu = None if device == "cpu" else get_gpu(spec.cluster.gpu)
    return plan_layout, training, gpu, assumptions


def _lora_shape(spec: JobSpec):
    """training.lora as the planner counts it; None without LoRA (or when its targets are wrong: check_lora says)."""
    from toolkit.plan.lora import LoraShape, projections_of

    if spec.training.lora is None:
        return None
    try:
        modules = spec_lora_modules(spec)
    except DsmtError:
        return None
    projections = {p for m in modules for p in projections_of(linear=m.linear, kind=m.kind.value, slot=m.slot)}
    return LoraShape(rank=spec.training.lora.rank, projections=frozenset(projections),
                     train_embeddings=spec.training.lora.train_embeddings)


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
        layout, training, gpu, assumptions = planner_inputs(spec)
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


def check_encoder_model(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """A BERT-style encoder (an adapter family with heads: toolkit/adapters/encoder.py) is built from megatron's local
    post-LayerNorm layers and trains the task of its head on real records."""
    import json

    from toolkit.adapters.family import AdapterError, get_family, supported_model_types

    model_type = spec_model_type(spec)
    if model_type not in supported_model_types() or not get_family(model_type).is_encoder:
        return []
    problems = encoder_dpo_problems(spec=spec, model_type=model_type)
    config = json.loads((Path(spec.model.path) / "config.json").read_text())
    try:
        get_family(model_type).head_for(config.get("architectures"))
    except AdapterError as err:
        problems.append(Problem("error", "encoder_head", str(err), "save the model with a supported head class"))
    attention = spec_attention(spec)
    if attention == "fused" or spec.parallel.cp > 1:
        problems.append(Problem("error", "encoder_layers",
                                f"model_type {model_type} with training.attention={attention}, parallel.cp="
                                f"{spec.parallel.cp}: the encoder is built from megatron's local post-LayerNorm "
                                "layers, which have no fused attention and no context parallelism",
                                "set training.attention: local and parallel.cp: 1"))
    problems += megatron_rows_only_problems(data=spec.data, trainer=f"the {model_type} head's task",
                                            record_types=True)
    if spec.data.synthetic:
        problems.append(Problem("error", "encoder_synthetic_data",
                                f"data.synthetic=true: model_type {model_type} trains its head's task "
                                f"({(config.get('architectures') or ['?'])[0]}) on real records only",
                                "set data.path (text records; with data.label_field for classification)"))
    return problems


def check_packing(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """data.packing (causal LM on real data): packed records are not cut for context parallelism, and Transformer
    Engine takes them as one THD row per micro-batch, which the pipeline's activation shapes do not allow at PP > 1
    (toolkit/train/engine/tasks.py, toolkit/adapters/packed.py)."""
    from toolkit.spec.layout import spec_is_encoder

    data, parallel, micro = spec.data, spec.parallel, spec.training.micro_batch_size
    no_source = data.path is None and data.blend is None and data.mix is None
    if not data.packing or data.synthetic or no_source or spec_is_encoder(spec):
        return []
    problems = []
    if parallel.cp > 1:
        problems.append(Problem("error", "packing_context_parallel", f"data.packing=true with parallel.cp="
                                f"{parallel.cp}: packed records are not supported under context parallelism",
                                "set data.packing: false (one record per sequence) or parallel.cp: 1"))
    if spec_attention(spec) == "fused" and parallel.pp > 1 and micro > 1:
        problems.append(Problem("error", "packing_fused_micro_batch", f"data.packing=true with training.attention="
                                f"fused, pp={parallel.pp} and micro_batch_size={micro}: Transformer Engine takes "
                                "packed records as one THD row per micro-batch, and pipeline activations are "
                                "micro_batch_size x seq_length", "set training.micro_batch_size: 1 (more gradient "
                                "accumulation keeps the batch), or data.packing: false"))
    if spec_attention(spec) == "fused" and spec.training.precision == "fp32":
        problems.append(Problem("error", "packing_fused_fp32", "data.packing=true with training.attention=fused and "
                                "training.precision=fp32: Transformer Engine takes packed records as THD, and none of "
                                "its attention kernels runs THD in fp32 (flash and cuDNN attention take fp16 / bf16; "
                                "its unfused attention takes no THD)", "set training.precision: bf16, "
                                "training.attention: local, or data.packing: false"))
    return problems


def check_sync_batchnorm(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """training.sync_batchnorm acts on BatchNorm layers (ResNet); a transformer has none."""
    if not spec.training.sync_batchnorm:
        return []
    return [Problem("warning", "sync_batchnorm_no_batchnorm", f"training.sync_batchnorm=true has no effect on "
                    f"{shape.name}: a transformer has no BatchNorm layers", "remove training.sync_batchnorm")]


def check_wandb(*, spec: JobSpec, shape: ModelShape | None) -> list[Problem]:
    """training.wandb needs the wandb package: DeepSpeed's monitor imports it inside `deepspeed.initialize` on rank
    0, after the model is built; here it fails before anything starts (`dsmt check`, `dsmt train`, every rank)."""
    if spec.training.wandb is None:
        return []
    try:
        import wandb  # noqa: F401  (only with training.wandb: ~0.4 s)
    except Exception as err:  # ImportError, or a broken install failing inside its own imports
        return [Problem("error", "wandb_missing", f"training.wandb (project {spec.training.wandb.project}) is set but "
                        f"`import wandb` fails here: {type(err).__name__}: {err}",
                        "pip install 'dsmt[wandb]' where the ranks run, or remove training.wandb")]
    return []


CHECKS: tuple[Check, ...] = (
    check_layout, check_vocab_padding, check_precision_on_device, check_mixed_precision, check_hosts_for_multi_node,
    check_lengths_and_intervals, check_export_hf_interval, check_data, check_validation_data, check_builtin_tokenizer,
    check_memory_fit, check_encoder_model, check_sync_batchnorm, check_lora, check_packing, check_model_files,
    check_model_family, check_model_adapter, check_wandb, check_preference,
)
RECORD_CHECKS: tuple[Check, ...] = (check_data, check_validation_data)  # those `skip_records` stands in for


def plain_model_problems(*, spec: JobSpec) -> list[Problem] | None:
    """Checks for an HF model that is not a transformer LM (e.g. ResNet): it trains with DeepSpeed data
    parallelism only, so only tp = pp = 1 and the batch arithmetic apply. None when model.path is no such model."""
    model_type = spec_model_type(spec) if spec.model.path is not None else None
    if model_type is None:
        return None
    problems = no_adapter_problems(spec=spec, model_type=model_type)
    problems += run_problems(layout=parallel_layout(spec), run=spec_run_facts(spec))
    problems += check_model_files(spec=spec, shape=None)
    problems += check_validation_data(spec=spec, shape=None)  # evaluated by PlainEngine.eval_step
    problems += check_export_hf_interval(spec=spec, shape=None)
    problems += check_wandb(spec=spec, shape=None)
    problems += check_plain_model_data(spec=spec, model_type=model_type)
    problems += plain_dpo_problems(spec=spec, model_type=model_type)
    return problems


def run_checks(*, spec: JobSpec, source: str = "job spec", skip_records: str | None = None) -> Report:
    """Every cross-section problem of a validated spec, in one report. `skip_records`: why the data's records are
    not formatted here (check_data); None: every record is (`dsmt check`)."""
    from toolkit.spec.paths import output_dir_problems

    problems: list[Problem] = output_dir_problems(output_dir=spec.training.output_dir)  # whatever the model
    try:
        shape = model_shape(spec.model)
    except ModelShapeError as err:
        plain = plain_model_problems(spec=spec)
        return Report(source=source, problems=(*problems, *(plain if plain is not None else (shape_problem(err),))))
    for check in CHECKS:
        extra = {"skip_records": skip_records} if check in RECORD_CHECKS else {}
        problems.extend(check(spec=spec, shape=shape, **extra))
    return Report(source=source, problems=tuple(problems))


def check_file(path: str | Path, *, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobSpec | None, Report]:
    """Load, validate and check `path`: (spec or None when it does not validate, the report)."""
    try:
        spec = validate_spec(read_spec(path, overrides=overrides), source=str(path))
    except SpecError as err:
        return None, err.report
    return spec, run_checks(spec=spec, source=str(path))
