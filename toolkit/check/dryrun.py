"""`dsmt train SPEC --dry-run`: everything `dsmt train` checks before it launches, done here, writing nothing.

One report (exit 0, or 2 listing every problem found, not just the first):
  * the spec: `dsmt check` (schema and cross-section rules) and what the trainer refuses beyond it;
  * the model: its config translated by the adapters, the layout checked against it (`Layout.problems`), and the
    first and last pipeline stage of this layout built as megatron-core GPTModel chunks on the meta device (no
    memory, no initialisation), by a fake process group that puts this one process at that stage's rank;
  * the DeepSpeed config, accepted by DeepSpeed's own parser at the layout's data-parallel size; with `--run-dir`
    the run directory's ds_config.json and megatron.json compared with the spec first (`toolkit/train/job/run_files.py`:
    contradictions are errors, edited tuning keys are listed) and the file's config is the one parsed;
  * the data readable (`load_records`), and the tokenizer present and no larger than the model's vocabulary.
"""

from __future__ import annotations

import dataclasses
import unittest.mock
from pathlib import Path

from toolkit.errors import DsmtError, Problem, Report
from toolkit.parallel.rules import MODEL_RULES
from toolkit.check.dryrun_data import data_problems

# `dsmt check` rules that already say the layout does not fit the model (the meta build is skipped after them).
LAYOUT_RULES = MODEL_RULES | {"world_size"}


def dry_run(path: str | Path, *, overrides: list[str] | tuple[str, ...] = (), run_dir: Path | None = None,
            allow_changes: bool = False) -> Report:
    return prelaunch(path, overrides=overrides, run_dir=run_dir, allow_changes=allow_changes)[1]


def prelaunch(path: str | Path, *, overrides: list[str] | tuple[str, ...] = (),
              run_dir: Path | None = None, allow_changes: bool = False) -> tuple[object, Report]:
    """(the spec or None, the report): the one pass `dsmt check --deep`, `dsmt train --dry-run` and `dsmt train`
    (before any rank starts) run. `allow_changes`: --continue-with-changes (toolkit/train/job/run_identity.py)."""
    from toolkit.check.checks import check_file

    spec, report = check_file(path, overrides=overrides)
    source = f"{path} (dsmt train --dry-run)"
    if spec is None:  # the schema refused it: nothing further can be read from it
        return None, Report(source=source, problems=report.problems)
    return spec, prelaunch_pass(spec=spec, report=report, source=source, spec_ref=str(path), run_dir=run_dir,
                                allow_changes=allow_changes)[0]


def prelaunch_pass(*, spec, report: Report, source: str, spec_ref: str, run_dir: Path | None = None,
                   allow_changes: bool = False) -> tuple[Report, dict | None]:
    """(the report, the run directory's ds_config or None): what the pass adds to `dsmt check`'s `report` of a
    validated `spec` (`spec_ref`: how messages name it)."""
    from toolkit.train.job import run_identity

    problems = trainer_problems(spec=spec) + side_file_problems(spec=spec)
    if not report.rules("error"):  # the spec's own errors first: a broken spec says nothing of the run it continues
        problems += run_identity.problems(spec=spec, allow_changes=allow_changes)
    # no model at model.path (model_shape) or its weights unreadable (checkpoint_unreadable): dsmt check's line
    # says why, and nothing more (config, tokenizer) is read from it
    model_refused = bool({"model_shape", "checkpoint_unreadable"} & report.rules())
    settings, facts, model_found = (None, None, []) if model_refused else model_settings_of(spec=spec)
    problems += model_found
    if settings is not None:
        from toolkit.train.lora.export import init_adapter_problems

        problems += layout_and_build_problems(spec=spec, settings=settings, facts=facts,
                                              spec_errors=report.rules("error"))
        problems.append(fusion_problem(spec=spec, settings=settings))
        problems += kernel_path_problems(spec=spec, settings=settings)
        problems += init_adapter_problems(spec=spec, settings=settings)
    ds_config, files_found = run_files_problems(spec=spec, run_dir=run_dir, spec_ref=spec_ref)
    problems += files_found
    problems += deepspeed_problems(spec=spec, ds_config=ds_config)
    problems += data_problems(spec=spec, model_refused="model_shape" in report.rules())  # dryrun_data.py
    # dsmt check's model and data checks read some of the same things: one line per problem
    said = {(p.rule, p.message) for p in report.problems}
    return Report(source=source, problems=(*report.problems,
                                           *(p for p in problems if (p.rule, p.message) not in said))), ds_config


def side_file_problems(*, spec) -> list[Problem]:
    """model.path's tokenizer and config side files that link outside the checkpoint: the export copies them, so
    they are named here rather than after the last step (toolkit/convert/checkpoint.py side_files)."""
    from toolkit.convert.checkpoint import SideFileOutsideSource, side_files

    if spec.model.path is None or not Path(spec.model.path).is_dir():
        return []
    try:
        side_files(Path(spec.model.path))
    except SideFileOutsideSource as err:
        return [Problem("error", err.rule, err.detail, err.fix)]
    return []


def trainer_problems(*, spec) -> list[Problem]:
    """What `dsmt train` / `python -m toolkit.train` refuse or need beyond `dsmt check`."""
    import torch

    found = []
    if spec.cluster.nodes > 1:
        found.append(Problem("info", "launch", f"cluster.nodes={spec.cluster.nodes}: `dsmt train` starts ranks on this "
                             "machine only; `dsmt generate SPEC --out run/` writes the launch scripts (launch_deepspeed.sh, "
                             "job.sbatch) that start `python -m toolkit.train` on every rank"))
    if (spec.cluster.device == "cuda") != torch.cuda.is_available():
        found.append(Problem("warning", "device_here",
                             f"cluster.device={spec.cluster.device} but this machine "
                             f"{'has' if torch.cuda.is_available() else 'has no'} CUDA: `dsmt train` here would refuse",
                             "run the training where the spec's device is; the dry run itself needs none"))
    found += attention_problems(spec=spec)
    if Path(spec.training.output_dir).expanduser().is_dir():  # a file there: dsmt check says so
        found.append(Problem("info", "resume", f"training.output_dir={spec.training.output_dir} exists: a run there "
                             "resumes from its latest complete checkpoint"))
    return found


def attention_problems(*, spec) -> list[Problem]:
    """The attention kind the run's layers will use, and whether this machine could build them."""
    import importlib.util

    from toolkit.spec.layout import spec_attention

    attention = spec_attention(spec)
    layers = ("Transformer Engine layers (fused attention, no s × s scores stored)" if attention == "fused" else
              "megatron's local torch layers (unfused attention: the s × s scores are stored)")
    found = [Problem("info", "attention", f"training.attention={spec.training.attention}: {layers}")]
    if attention == "fused" and importlib.util.find_spec("transformer_engine") is None:
        found.append(Problem("warning", "transformer_engine_here", "training.attention resolves to fused but "
                             "transformer_engine is not importable on this machine: the ranks refuse to build without it",
                             "install transformer-engine on the training nodes (this machine may only plan), or set "
                             "training.attention: local" + (" and parallel.cp: 1" if spec.parallel.cp > 1 else "")))
    return found


def model_settings_of(*, spec):
    """(ModelSettings or None, ModelFacts or None, problems): the adapters' view of the spec's model and what a
    layout must divide of it (toolkit/adapters/model_shape.py: the reading `dsmt check` does), without any weights."""
    from toolkit.adapters.hf_config import model_settings
    from toolkit.adapters.model_shape import model_facts
    from toolkit.adapters.hf_source import QuantizedCheckpointError
    from toolkit.train.job import pretrain

    multiple, info = spec.model.make_vocab_size_divisible_by, None
    try:
        if spec.model.builtin is not None:
            hf_config = pretrain.hf_config(spec.model.builtin)
            where = (f"model.builtin={spec.model.builtin}: megatron-core init, std "
                     f"{hf_config.initializer_range}; rank 0 writes config.json and tokenizer files, no weights")
        elif spec.model.config is not None:
            from transformers import AutoConfig

            fields = dict(spec.model.config)
            if "model_type" not in fields:  # the random init (toolkit/models/tiny.py save_random_init) needs it
                return None, None, [Problem("error", "model_config", "model.config has no model_type: `dsmt train` cannot "
                                      "tell which HF model to initialise", "add model.config.model_type, e.g. llama")]
            hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            where = "model.config: a random HF init written by rank 0"
        else:
            from toolkit.convert.chunks import inspect_checkpoint
            from toolkit.train.plain import engine as plain

            path = Path(spec.model.path)
            if not path.exists():
                return None, None, []  # dsmt check's model_shape says so
            if (path / "config.json").is_file() and plain.is_plain_model(path):
                return None, None, [Problem("info", "model", f"model.path={spec.model.path}: no megatron-core adapter; "
                                      "DeepSpeed ZeRO data parallelism only")]
            info = inspect_checkpoint(path)
            hf_config, multiple = info.hf_config, info.vocab_pad_multiple
            where = f"model.path={spec.model.path} ({info.kind} checkpoint, {info.params_dtype})"
        # a checkpoint's as inspect_checkpoint read them (a multimodal one's with its tensor names: which are tied)
        settings = info.settings if info is not None else model_settings(hf_config, vocab_pad_multiple=multiple)
        facts = model_facts(hf_config, vocab_pad_multiple=multiple)
    except QuantizedCheckpointError as err:  # FP8 / quantised weights: the rule and fix are the reader's
        return None, None, [Problem("error", err.rule, err.detail, err.fix)]
    except DsmtError as err:
        if spec.model.builtin is None:  # the checkpoint's own files or config: the message names what and how
            return None, None, [Problem("error", getattr(err, "rule", "model_config"), str(err), getattr(err, "fix", ""))]
        from toolkit.adapters.family import supported_model_types

        return None, None, [Problem("error", "builtin_not_trainable", str(err), f"use a model dsmt has an adapter for "
                              f"({', '.join(supported_model_types())}), or one it trains data-parallel only")]
    except (ValueError, TypeError, KeyError) as err:  # transformers' own refusals of an inline config
        return None, None, [Problem("error", "model_config", f"model.config is not a valid HF config: {err}", "")]
    return settings, facts, [Problem("info", "model", f"{where}; {settings.family.model_type}, vocab_size="
                              f"{settings.vocab_size} (padded {settings.padded_vocab_size})")]


def layout_and_build_problems(*, spec, settings, facts, spec_errors: set[str]) -> list[Problem]:
    from toolkit.train.job.run import params_dtype

    if spec_errors & LAYOUT_RULES:
        return [Problem("info", "model_build", "model build: skipped, the layout does not fit the model (above)")]
    from toolkit.parallel.rules import layout_errors
    from toolkit.check.checks import spec_run_facts
    from toolkit.spec.layout import parallel_layout

    layout = parallel_layout(spec)
    if layout.world_size != spec.cluster.nodes * spec.cluster.gpus_per_node:
        return []  # reported by dsmt check's world_size
    # The same rules on the checkpoint's own numbers (its config.json may differ from what `dsmt check` read).
    layout_found = [p for p in layout_errors(layout=layout, model=facts,
                                             run=spec_run_facts(spec)) if p.rule not in spec_errors]
    if layout_found:
        return [Problem("error", "model_layout", f"[{p.rule}] {p.message}", p.fix, p.valid) for p in layout_found]
    try:
        counts = stage_parameter_counts(settings=settings, layout=layout,
                                        params_dtype=params_dtype(spec.training.precision),
                                        recompute=spec.training.recompute)
    except Exception as err:  # megatron-core's own refusals (asserts, ValueErrors) of this config at this layout
        return [Problem("error", "model_build", f"megatron-core could not build the model at tp={layout.tp} "
                        f"pp={layout.pp} vpp={layout.vpp}: {type(err).__name__}: {err}", "")]
    if counts is None:
        return [Problem("info", "model_build", "model build: skipped, a process group is already running here")]
    stages = ", ".join(f"{name} stage {count / 1e6:,.1f}M" for name, count in counts.items())
    kind = "encoder" if settings.encoder is not None else "GPTModel"
    return [Problem("info", "model_build", f"megatron-core {kind} built on the meta device at tp={layout.tp} "
                    f"pp={layout.pp} vpp={layout.vpp}: parameters per GPU: {stages}")]


def stage_parameter_counts(*, settings, layout, params_dtype, recompute: str = "none") -> dict[str, int] | None:
    """Parameters per GPU of the first and last pipeline stage (all their virtual chunks), counted on the chunks
    `dsmt train` builds (GPTModel, or BERT's encoder) on the meta device. torch's fake process-group backend (what
    torch's own tests use to stand in for a large world in one process; collectives do nothing) puts this process
    at the stage's rank, so
    megatron shards exactly as it will at that rank. None when a process group already exists here."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from toolkit import backend as backends
    from toolkit.adapters.build import model_chunks, transformer_config

    if dist.is_initialized():
        return None
    backends.current()  # on a CPU machine: megatron's CUDA calls redirected before any model code runs
    # megatron's default rank order is tp-cp-ep-dp-pp: the pipeline rank is the outermost coordinate.
    ranks = {"first": 0, "last": (layout.pp - 1) * layout.tp * layout.cp * layout.dp}
    counts = {}
    for name, rank in ranks.items():
        if name == "last" and layout.pp == 1:
            break
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
                context_parallel_size=layout.cp, create_gloo_process_groups=False)
            config = transformer_config(settings=settings, layout=layout, params_dtype=params_dtype, recompute=recompute)
            # CPU-style allocation honours the meta device context (the CUDA path names a device explicitly).
            # cp and sp change no parameter shape; the local layers have neither (Transformer Engine's do). Set
            # on the built config, not dataclasses.replace'd: a replace drops what the build set beside the
            # dataclass fields (Phi-4-mini's cos / sin factor, toolkit/adapters/longrope.py scale_rotation).
            for field, value in dict(use_cpu_initialization=True, perform_initialization=False,
                                     context_parallel_size=1, sequence_parallel=False).items():
                setattr(config, field, value)
            # the local layers (with the family's deltas): the parameter shapes of the Transformer Engine ones,
            # and they allocate nothing real on the meta device.
            local = dataclasses.replace(layout, cp=1, sp=False)
            with torch.device("meta"):
                chunks = model_chunks(config=config, settings=settings, layout=local, attention="local",
                                      parallel_output=True)
                counts[name] = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return counts


class LayoutMpu:
    """The model-parallel unit DeepSpeed's config parser asks for the data-parallel size (no process group)."""

    def __init__(self, layout):
        self.layout = layout

    def get_data_parallel_world_size(self): return self.layout.zero_size  # dp × cp, as MegatronMpu
    def get_data_parallel_rank(self): return 0
    def get_model_parallel_world_size(self): return self.layout.tp * self.layout.pp
    def get_model_parallel_rank(self): return 0
    def get_tensor_model_parallel_world_size(self): return self.layout.tp
    def get_tensor_model_parallel_rank(self): return 0
    def get_pipeline_model_parallel_world_size(self): return self.layout.pp
    def get_pipeline_model_parallel_rank(self): return 0


def run_files_problems(*, spec, run_dir: Path | None, spec_ref: str) -> tuple[dict | None, list[Problem]]:
    """(the run directory's ds_config or None, problems): what `python -m toolkit.train --run-dir` checks at start."""
    from toolkit.train.job.run_files import RULE, RunFilesError, compare_run_files

    if run_dir is None:
        return None, []
    try:
        files = compare_run_files(run_dir=run_dir, spec=spec)
    except RunFilesError as err:
        return None, [Problem("error", err.rule, err.detail, err.fix)]
    except DsmtError:
        return None, []  # the layout arithmetic is wrong; dsmt check's errors above say how
    if files.contradictions:  # the trainer stops here; DeepSpeed's parser below reads the spec's config
        return None, [Problem("error", RULE, f"{d.line()}: {files.run_dir} contradicts the spec {spec_ref}",
                              files.fix()) for d in files.contradictions]
    if not files.overrides:
        return files.ds_config, [Problem("info", "run_files", files.start_lines()[0].removeprefix("dsmt train: "))]
    return files.ds_config, [Problem("info", "run_files_override", f"ds_config.json overrides the spec: {d.line()}")
                             for d in files.overrides]


def deepspeed_problems(*, spec, ds_config: dict | None = None) -> list[Problem]:
    import deepspeed
    from deepspeed.runtime import config as ds_config_module

    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.spec.layout import derive_layout

    try:
        layout = derive_layout(spec)
    except DsmtError:
        return []  # the batch / world arithmetic is wrong; dsmt check's errors above say how
    config = build_deepspeed_config(spec=spec, layout=layout) if ds_config is None else ds_config
    which = "generated ds_config" if ds_config is None else "run directory's ds_config.json"
    # The parser reads the mpu only when deepspeed.comm answers get_rank(); without a process group it would
    # silently assume one rank. Rank 0 of the layout's world is what it must see.
    try:
        with unittest.mock.patch.object(ds_config_module.dist, "get_rank", lambda *args, **kwargs: 0):
            parsed = ds_config_module.DeepSpeedConfig(config, mpu=LayoutMpu(layout))
    except Exception as err:  # DeepSpeed refuses with asserts, ValueErrors and pydantic errors alike
        return [Problem("error", "deepspeed_config", f"DeepSpeed {deepspeed.__version__} refuses the {which} "
                        f"at dp={layout.dp}: {type(err).__name__}: {err}", "")]
    seen = (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps)
    wanted = (layout.global_batch_size * layout.cp, layout.micro_batch_size, layout.grad_accum_steps)
    if seen != wanted:
        return [Problem("error", "deepspeed_config", f"DeepSpeed reads (train_batch_size, micro, grad-accum) = {seen}, "
                        f"the layout says {wanted}", "")]
    return [Problem("info", "deepspeed_config", f"DeepSpeed {deepspeed.__version__} accepts ds_config: "
                    f"train_batch_size={layout.global_batch_size * layout.cp} = micro {layout.micro_batch_size} × "
                    f"grad-accum {layout.grad_accum_steps} × dp {layout.dp}" + (f" × cp {layout.cp}" if layout.cp > 1
                                                                                else "")
                    + f", ZeRO-{parsed.zero_optimization_stage}")]


def fusion_problem(*, spec, settings):
    """The dry run's line: the fusions the spec's ranks will choose on its device and layers (the run may be
    checked on a machine without them; Transformer Engine's layers bring its fused RoPE)."""
    from toolkit.adapters.fusions import describe, fusion_fields
    from toolkit.spec.layout import spec_attention

    te_layers, fusions = spec_attention(spec) == "fused", spec.training.fusions
    fields = fusion_fields(settings=settings, device=spec.cluster.device, te_layers=te_layers, fused_rope=te_layers,
                           fusions=fusions)
    where = (f"cluster.device={spec.cluster.device}, {'Transformer Engine' if te_layers else 'local'} layers, "
             f"training.fusions={fusions}")
    return Problem("info", "fusions", f"{where}: {describe(fields, fusions=fusions)}")


def kernel_path_problems(*, spec, settings) -> list[Problem]:
    """Lines on the kernels the GPU path runs where they are not the fastest megatron-core has: MoE experts one GEMM
    per expert, and MLA's packed records rotated by megatron's unfused THD RoPE."""
    from toolkit.spec.layout import spec_attention

    problems = []
    if settings.num_experts:
        problems.append(Problem("info", "moe_experts", (
            f"MoE experts: megatron's SequentialMLP, one GEMM per local expert ({settings.num_experts} experts over "
            f"ep={spec.parallel.ep}); Transformer Engine's grouped GEMM (TEGroupedMLP) is not used: it keeps a "
            "layer's experts in one module (weight0..weightN-1), which dsmt's loader, LoRA and checkpoint shares do "
            "not read yet")))
    mla = bool(settings.transformer_fields.get("multi_latent_attention"))
    if mla and spec.data.packing and spec_attention(spec) == "fused":
        problems.append(Problem("info", "mla_packed_rope", (
            "multi-latent attention with data.packing on Transformer Engine: megatron-core's unfused THD RoPE reads "
            "each micro-batch's record lengths back to the host in every layer (a wait for the GPU per layer; "
            "dsmt keeps MLA on the unfused RoPE, toolkit/adapters/fusions.py); data.packing: false avoids it")))
    return problems
