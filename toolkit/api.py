"""dsmt's Python API: what `dsmt check`, `dsmt generate`, `dsmt plan` and `dsmt train` do, for scripts.

    from toolkit import api

    spec = api.job_spec({"model": {"path": "ckpt/"}, "cluster": {...}, "parallel": {"tp": 2}, ...})
    report = api.check(spec)                    # every problem at once; report.ok, report.to_text()
    api.generate(spec, out_dir=Path("run/"))    # ds_config.json, megatron.json, launch scripts, hostfile
    history = api.train(spec)                   # ranks on this machine, as `dsmt train`; per-step metrics

    run = api.initialize(spec)                  # in every process of YOUR script under deepspeed / torchrun / srun
    stats = run.train_step(micro_batches)       # HF-convention batches: {"loss", "grad_norm", "lr", "tokens"}
    run.save_checkpoint("ckpt/"); run.export_hf("hf-out/")

A spec is the same `JobSpec` the YAML files validate into (toolkit/spec/schema.py), so a script that builds specs
in a loop gets the same checks and the same generated files as the CLI. Errors raise `DsmtError`s (bad specs a
`SpecError` carrying the whole report); nothing is written for a spec that does not pass its checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from toolkit.errors import Report
from toolkit.spec.schema import JobSpec


def job_spec(fields: dict[str, Any], *, overrides: list[str] | tuple[str, ...] = (), source: str = "job spec") -> JobSpec:
    """A validated spec from a mapping with the YAML's sections; `overrides` as `--set` ("parallel.tp=4")."""
    from toolkit.spec.load import apply_overrides, validate_spec

    return validate_spec(apply_overrides(fields, overrides=overrides), source=source)


def load_job(path: str | Path, *, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """The validated spec of a YAML / JSON file (as `dsmt check FILE` reads it)."""
    from toolkit.spec.load import load_spec

    return load_spec(path, overrides=overrides)


def check(spec: JobSpec, *, source: str = "job spec") -> Report:
    """`dsmt check`: every cross-section problem of the spec (layout rules, batch arithmetic, memory, data)."""
    from toolkit.check.checks import run_checks

    return run_checks(spec=spec, source=source)


def generate(spec: JobSpec, *, out_dir: Path, overwrite: bool = False,
             templates: Path | None = None) -> list[Path]:
    """`dsmt generate`: the run directory (DeepSpeed JSON, megatron settings, deepspeed / torchrun / SLURM scripts,
    hostfile, resolved spec), written atomically; raises SpecError (nothing written) when the spec has errors.
    `templates`: a directory of site copies of launch/'s templates (`dsmt generate --templates`); a bad template
    raises DsmtError, again with nothing written. Relative paths of the spec (output_dir's default included) are
    taken against the working directory, as `dsmt generate` does: the run directory's copy holds absolute ones, so
    job.sbatch and the launch scripts find the same directories whatever directory they run from."""
    from toolkit.check.job import check_job
    from toolkit.generate.templates import load_templates
    from toolkit.generate.writer import write_run_dir
    from toolkit.spec.load import absolutize_paths

    site_templates = load_templates(site_dir=Path(templates) if templates is not None else None)
    spec = absolutize_paths(spec, base_dir=Path.cwd())  # read back against the run dir, they would mean another one
    return write_run_dir(job=check_job(spec), out_dir=Path(out_dir), overwrite=overwrite, templates=site_templates)


def train(spec: JobSpec, *, spec_file: Path | None = None, continue_with_changes: bool = False) -> list[dict]:
    """`dsmt train`: check the spec (everything `dsmt train --dry-run` checks; SpecError with nothing written),
    start its ranks on this machine and wait; returns the per-step metrics (the training lines of
    training.output_dir/metrics.jsonl: `validation_history` has the evaluations). The spec, its relative paths
    taken against the working directory, is written to `spec_file` (default OUTPUT_DIR/job.yaml) for the ranks.
    `continue_with_changes`: as `dsmt train --continue-with-changes` (toolkit/train/job/run_identity.py)."""
    from toolkit.check.prelaunch import checked_before_launch
    from toolkit.launch.rank_output import quiet_library_warnings
    from toolkit.spec.load import absolutize_paths, dump_spec
    from toolkit.train.job.launch import SPEC_FILE, launch_training

    quiet_library_warnings()
    spec = absolutize_paths(spec, base_dir=Path.cwd())  # the file below must not depend on its own folder
    output_dir = Path(spec.training.output_dir)
    spec_file = Path(spec_file) if spec_file is not None else output_dir / SPEC_FILE
    # named by the file the ranks will read (written once the checks pass): `dsmt train FILE --dry-run` runs again
    job = checked_before_launch(spec=spec, source=str(spec_file), allow_changes=continue_with_changes)
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(dump_spec(spec))
    launch_training(job=job, spec_file=spec_file)
    return [record for record in _metrics(output_dir) if "loss" in record]


def initialize(spec: JobSpec | dict[str, Any] | str | Path, *, overrides: list[str] | tuple[str, ...] = ()):
    """For a training script of one's own: call it in every process of a job started by `deepspeed`, torchrun or
    srun, as `deepspeed.initialize`. It checks the spec (as `dsmt check`; the `data` section may be left out, and
    the records of one that is there are not read: the script brings its batches), sets
    CUDA_DEVICE_MAX_CONNECTIONS as the generated launch scripts do (`ordered_kernel_launches`), sets up the process
    groups of its layout, builds this rank's megatron-core chunks with the checkpoint's weights (LoRA when
    `training.lora`), and wraps them in DeepSpeed with the config `dsmt generate` writes. Returns a `TrainingRun`
    (toolkit/train/job/session.py):

        run.train_step(micro_batches)  # pulls run.micro_batches_per_step HF batches (input_ids, labels, ...)
        run.eval_step(micro_batches)   # {"loss", "tokens"}
        run.save_checkpoint(dir), run.load_checkpoint(dir), run.export_hf(dir)
        run.dp_rank, run.dp_size, run.micro_batches_per_step, run.layout, run.engine, run.model_chunks

    `spec`: a JobSpec, a mapping with the YAML's sections, or a YAML / JSON path; `overrides` as `--set`. Under a
    launcher its process count is the cluster (rank 0 says so where the spec's differs; toolkit/spec/launched.py).
    A spec that fails its checks raises SpecError on every rank before any process group exists."""
    from toolkit.launch.rank_output import quiet_library_warnings, this_rank

    quiet_library_warnings(only_libraries=True)  # before megatron's imports: ~20 "Apex is not installed" per rank
    from toolkit.spec.launched import fit_to_launch
    from toolkit.train.job.session import start_run

    if isinstance(spec, (str, Path)):
        spec = load_job(spec, overrides=overrides)
    elif not isinstance(spec, JobSpec):
        spec = job_spec(spec, overrides=overrides, source="initialize(spec)")
    elif overrides:
        spec = job_spec(spec.model_dump(mode="json"), overrides=overrides, source="initialize(spec)")
    spec, launch_line = fit_to_launch(spec, environ=os.environ)  # the launch's process count wins over the spec's
    if launch_line and this_rank() == 0:
        print(launch_line, flush=True)
    ordered_kernel_launches(spec=spec, environ=os.environ)
    from toolkit.check.job import check_job

    # No data.path is no error here, and no rank formats the records of a data section that is there: the script
    # brings its batches, so initialize's run reads none of them. Formatting them on every rank would cost minutes
    # before rendezvous on a large file; on rank 0 alone, rank 0 would be those minutes late to the rendezvous, and
    # a bad record would stop rank 0 only, after the others had gone on to wait for it there.
    job = check_job(spec, source="initialize(spec)", ignore_rules=frozenset({"data_source"}),
                    skip_records="the script brings its batches (`dsmt check` formats every record)")
    return start_run(job=job)


CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


class LaunchEnvironmentWarning(UserWarning):
    """The process environment differs from what dsmt's generated launch scripts export (toolkit/generate/env.py)."""


def ordered_kernel_launches(*, spec: JobSpec, environ) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS as the generated scripts export it (toolkit/generate/env.py: 1 on CUDA at
    tp > 1): megatron's tensor-parallel communication overlaps the GEMMs only when kernels launch in order on one
    hardware queue, and megatron-core warns without it. CUDA reads it when its context is created: set here while
    torch has not initialised CUDA; afterwards, or when the script set another value, a warning naming the fix."""
    from toolkit.generate.env import environment

    wanted = environment(spec=spec).get(CONNECTIONS_ENV)
    have = environ.get(CONNECTIONS_ENV)
    if wanted is None or have == wanted:
        return
    import torch

    if have is None and not torch.cuda.is_initialized():
        environ[CONNECTIONS_ENV] = wanted
        return
    why = (f"{CONNECTIONS_ENV}={have} in the environment" if have is not None else
           f"{CONNECTIONS_ENV} is unset and CUDA was initialised before toolkit.api.initialize, too late to set it")
    import warnings

    warnings.warn(f"[cuda_device_max_connections] {why}; dsmt's launch scripts export {CONNECTIONS_ENV}={wanted} "
                  f"at tp={spec.parallel.tp} (megatron's tensor-parallel communication overlap needs kernels "
                  f"launched in order)\nfix: export {CONNECTIONS_ENV}={wanted} before the script starts (or before "
                  "its first CUDA call)", LaunchEnvironmentWarning, stacklevel=3)


def validation_history(spec: JobSpec) -> list[dict]:
    """The evaluations of a finished or running `train(spec)`: `{"step", "val_loss", "val_tokens", "eval_time_s"}`
    per evaluation (step 0 is before the first step); empty without data.validation_path / validation_fraction."""
    return [record for record in _metrics(Path(spec.training.output_dir)) if "val_loss" in record]


def _metrics(output_dir: Path) -> list[dict]:
    metrics = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
