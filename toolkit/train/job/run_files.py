"""The run directory's ds_config.json and megatron.json against what the spec generates: the files are what runs.

`dsmt generate` writes both files from the spec; the launch scripts start `python -m toolkit.train --config
DIR/job.resolved.yaml --run-dir DIR` on every rank, which reads them back here before any process group exists.

Policy (the tables below name every key of the first kind):
  * Keys that define the layout, the batch, the precision or the ZeRO stage must agree with the spec. The spec's
    checks, the model build (TP / PP / SP / CP sizes, dtypes, recompute) and the data loader all follow the spec,
    so a file that says otherwise describes another run. A contradiction is the error `run_files_contradict_spec`
    (every key, both values, the fix), raised before any process group or model is built.
  * Every other ds_config.json key that differs (bucket sizes, overlap_comm, optimizer parameters, monitors,
    ...) is the user's edit and wins: the file's config is what `deepspeed.initialize` receives, and each
    such key is listed at start ("ds_config.json overrides the spec: ...").
  * megatron.json is the record of the megatron-core settings the trainer builds from the spec and the model's
    config.json; no key in it is read as a setting, so every edit there is a contradiction (it could not count).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from toolkit.errors import DsmtError, RuleError

DS_CONFIG, MEGATRON = "ds_config.json", "megatron.json"
RULE = "run_files_contradict_spec"
ABSENT = object()  # a key the file (or the spec's config) does not have

# ds_config.json keys that must agree -> (the spec setting behind them, DeepSpeed's value when the key is absent).
# Batch keys have no default here: DeepSpeed would derive a missing one, but the file must state what runs.
DS_MUST_AGREE = {
    "train_batch_size": ("training.global_batch_size (× parallel.cp)", ABSENT),
    "train_micro_batch_size_per_gpu": ("training.micro_batch_size", ABSENT),
    "gradient_accumulation_steps": ("training.global_batch_size / (micro_batch_size × dp)", ABSENT),
    "bf16.enabled": ("training.precision", False),
    "fp16.enabled": ("training.precision", False),
    "zero_optimization.stage": ("parallel.zero_stage", 0),
    "zero_optimization.offload_optimizer.device": ("parallel.offload_optimizer", "none"),
    "zero_optimization.offload_param.device": ("parallel.offload_params", "none"),
    # dsmt's engines hand deepspeed.initialize transformers' schedule (toolkit/spec/lr_schedule.py), which
    # wins over a config's: a "scheduler" section here would be silently ignored, so it is refused instead
    "scheduler": ("training.lr_schedule, warmup_steps and min_lr (transformers' schedule, not the file's)", ABSENT),
}
_DS_ALIASES = {"bf16.enabled": "bfloat16.enabled"}  # DeepSpeed's older name, read when "bf16" is absent

# megatron.json leaf key -> the spec setting it comes from (for the fix); other keys come from the model or backend.
MEGATRON_SOURCES = {
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    "virtual_pipeline_model_parallel_size": "parallel.vpp", "context_parallel_size": "parallel.cp",
    "sequence_parallel": "parallel.sequence_parallel", "bf16": "training.precision", "fp16": "training.precision",
    "params_dtype": "training.precision", "pipeline_dtype": "training.precision",
    "recompute_granularity": "training.recompute", "recompute_method": "training.recompute",
    "recompute_num_layers": "training.recompute", "num_microbatches": "training.global_batch_size",
    "micro_batch_size": "training.micro_batch_size", "seq_length": "training.seq_length",
    "global_batch_size": "training.global_batch_size", "world_size": "cluster.nodes × cluster.gpus_per_node",
    "data_parallel_size": "world / (parallel.tp × cp × pp)", "seed": "training.seed",
    "attention": "training.attention",
}


@dataclasses.dataclass(frozen=True)
class Difference:
    file: str  # DS_CONFIG or MEGATRON
    path: str  # dotted key path
    file_value: object  # ABSENT when the file lacks the key
    spec_value: object  # ABSENT when the spec's config lacks it
    must_agree: bool  # True: a contradiction (error); False: the file's value wins
    spec_field: str = ""  # the spec setting that decides this key
    file_default: object = ABSENT  # what DeepSpeed uses when the file lacks the key

    def line(self) -> str:
        winner = "must agree" if self.must_agree else "the file wins"
        source = f", set by {self.spec_field}" if self.spec_field else ""
        default = (f" (DeepSpeed's default {_show(self.file_default)})"
                   if self.file_value is ABSENT and self.file_default is not ABSENT else "")
        return (f"{self.file} {self.path}: file {_show(self.file_value)}{default}, spec {_show(self.spec_value)} "
                f"({winner}{source})")


class RunFilesError(RuleError):
    """The run directory's files are unreadable, or contradict the spec (rule `run_files_contradict_spec`)."""

    def __init__(self, message: str, *, rule: str = RULE, fix: str = ""):
        super().__init__(message, rule=rule, fix=fix)


@dataclasses.dataclass(frozen=True)
class RunFiles:
    run_dir: Path
    ds_config: dict  # the file's config: what deepspeed.initialize receives
    differences: tuple[Difference, ...]

    @property
    def contradictions(self) -> list[Difference]:
        return [d for d in self.differences if d.must_agree]

    @property
    def overrides(self) -> list[Difference]:
        return [d for d in self.differences if not d.must_agree]

    def start_lines(self) -> list[str]:
        """What rank 0 prints at start: every difference, with the side that wins."""
        if not self.differences:
            return [f"dsmt train: {self.run_dir}: {DS_CONFIG} and {MEGATRON} match the spec"]
        lines = []
        if self.overrides:
            lines.append(f"dsmt train: {DS_CONFIG} overrides the spec ({self.run_dir}; deepspeed.initialize "
                         f"receives the file):")
            lines += [f"  {d.line()}" for d in self.overrides]
        if self.contradictions:
            lines.append(f"dsmt train: {self.run_dir} contradicts the spec:")
            lines += [f"  {d.line()}" for d in self.contradictions]
        return lines

    def fix(self) -> str:
        fields = sorted({d.spec_field for d in self.contradictions if d.spec_field})
        return (f"make the change in the spec ({', '.join(fields) or 'the model'}) and regenerate (`dsmt generate "
                f"SPEC --out {self.run_dir} --overwrite`), or revert the file(s); only the other {DS_CONFIG} keys "
                f"(bucket sizes, overlap_comm, optimizer, monitors, ...) may be edited in place")

    def require_agreement(self, *, spec_ref: str) -> RunFiles:
        """self, or the named error listing every contradiction (before anything is started or written)."""
        found = self.contradictions
        if not found:
            return self
        raise RunFilesError(
            f"{self.run_dir} contradicts the spec {spec_ref} in {len(found)} key(s) that must agree ({DS_CONFIG}: "
            f"layout, batch, precision, ZeRO stage and offload; {MEGATRON}: every key, it records what the trainer "
            f"builds from the spec); nothing was started:\n" + "\n".join(f"  {d.line()}" for d in found),
            fix=self.fix())


def _show(value) -> str:
    return "<absent>" if value is ABSENT else json.dumps(value)


def flatten(data, *, prefix: str = "") -> dict[str, object]:
    """Dotted leaf paths of nested dicts; lists and scalars are leaves."""
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    leaves: dict[str, object] = {}
    for key, value in data.items():
        leaves.update(flatten(value, prefix=f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def lookup(data: dict, path: str, *, default=ABSENT):
    for key in path.split("."):
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _ds_effective(config: dict, path: str, *, default):
    """The value DeepSpeed acts on for a must-agree key (the older alias read when the current name is absent)."""
    alias = _DS_ALIASES.get(path)
    if alias and path.split(".")[0] not in config:
        return lookup(config, alias, default=default)
    return lookup(config, path, default=default)


# Keys the engine sets itself at pp > 1 (toolkit/train/engine/hybrid.py engine_config): an edit would take no effect.
DS_FIXED_AT_PP = {"zero_optimization.overlap_comm": ("parallel.pp (the engine turns it off at pp > 1)", False)}


def compare_ds_config(*, file_config: dict, spec_config: dict, pp: int = 1) -> list[Difference]:
    found = []
    must_agree = {**DS_MUST_AGREE, **(DS_FIXED_AT_PP if pp > 1 else {})}
    for path, (spec_field, default) in must_agree.items():
        file_value = _ds_effective(file_config, path, default=ABSENT)
        spec_value = _ds_effective(spec_config, path, default=default)
        if not _same(default if file_value is ABSENT else file_value, spec_value):
            found.append(Difference(DS_CONFIG, path, file_value, spec_value, must_agree=True, spec_field=spec_field,
                                    file_default=default))
    covered = {d.path for d in found} | {_DS_ALIASES[d.path] for d in found if d.path in _DS_ALIASES}
    file_leaves, spec_leaves = flatten(file_config), flatten(spec_config)
    for path in sorted(set(file_leaves) | set(spec_leaves)):
        file_value, spec_value = file_leaves.get(path, ABSENT), spec_leaves.get(path, ABSENT)
        inside = any(path == key or path.startswith(key + ".") for key in covered)
        if not inside and not _same(file_value, spec_value):
            found.append(Difference(DS_CONFIG, path, file_value, spec_value, must_agree=False))
    return found


def compare_megatron(*, file_settings: dict, spec_settings: dict) -> list[Difference]:
    file_leaves, spec_leaves = flatten(file_settings), flatten(spec_settings)
    return [Difference(MEGATRON, path, file_leaves.get(path, ABSENT), spec_leaves.get(path, ABSENT), must_agree=True,
                       spec_field=MEGATRON_SOURCES.get(path.rsplit(".", 1)[-1], "model.* (the model's config.json)"))
            for path in sorted(set(file_leaves) | set(spec_leaves))
            if not _same(file_leaves.get(path, ABSENT), spec_leaves.get(path, ABSENT))]


def _same(a, b) -> bool:
    """Equal as JSON values: True is not 1, 1.0 is 1."""
    if a is ABSENT or b is ABSENT:
        return a is b
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def read_json(path: Path) -> dict:
    regenerate = f"`dsmt generate SPEC --out {path.parent} --overwrite`"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunFilesError(f"{path} does not exist", rule="run_files_missing",
                            fix=f"pass the directory `dsmt generate` wrote, or write it with {regenerate}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunFilesError(f"{path} is not readable JSON: {err}", rule="run_files_unreadable",
                            fix=f"repair the edit, or regenerate the file with {regenerate}") from None
    if not isinstance(data, dict):
        raise RunFilesError(f"{path} holds a JSON {type(data).__name__}, not an object", rule="run_files_unreadable",
                            fix=f"regenerate it with {regenerate}")
    return data


def spec_path_for(*, config: str | None, run_dir: Path | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The job spec to train: the one given, else the run directory's job.resolved.yaml (what it was generated from).

    `--set` with a run directory is refused: its files were generated without the override, so a changed tuning
    key would silently lose to the file and a changed layout key would contradict it."""
    from toolkit.generate.scripts import RESOLVED_SPEC

    if overrides and run_dir is not None:
        raise RunFilesError(f"--set {' --set '.join(overrides)} with --run-dir {run_dir}: the run directory's files "
                            "were generated without it", rule="run_dir_with_overrides",
                            fix=f"regenerate with the override (`dsmt generate SPEC --set ... --out {run_dir} "
                            "--overwrite`), or edit a tuning key in its ds_config.json")
    if config:
        return str(config)
    if run_dir is None:
        raise DsmtError("no job spec: pass --config JOB.yaml, or --run-dir DIR (a `dsmt generate` directory; its "
                        f"{RESOLVED_SPEC} is the spec)")
    return str(Path(run_dir) / RESOLVED_SPEC)


def compare_run_files(*, run_dir: Path, spec) -> RunFiles:
    """Read DIR/ds_config.json and DIR/megatron.json and compare them with what `spec` generates."""
    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.generate.megatron_settings import build_megatron_settings
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import model_shape

    run_dir = Path(run_dir).expanduser().absolute()
    file_config, file_settings = read_json(run_dir / DS_CONFIG), read_json(run_dir / MEGATRON)
    layout = derive_layout(spec)
    spec_config = build_deepspeed_config(spec=spec, layout=layout)
    spec_settings = build_megatron_settings(spec=spec, layout=layout, shape=model_shape(spec.model))
    differences = (compare_ds_config(file_config=file_config, spec_config=spec_config, pp=layout.pp)
                   + compare_megatron(file_settings=file_settings, spec_settings=spec_settings))
    return RunFiles(run_dir=run_dir, ds_config=file_config, differences=tuple(differences))
