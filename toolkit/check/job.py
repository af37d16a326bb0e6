"""Checks in, `CheckedJob` out (toolkit/spec/checked.py): the one way a spec becomes something a runner takes.

    job = check_job(spec, source="job.yaml")                         # `dsmt check`'s checks (dsmt generate, a rank)
    job = check_job(spec, source="job.yaml", before_launch=True)     # and the pre-launch pass (`dsmt train`)

Raises SpecError carrying the whole report when any check finds an error; the report's warnings and notes travel
in the job."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from toolkit.errors import DsmtError, Report, SpecError
from toolkit.spec.checked import CheckedJob
from toolkit.spec.schema import JobSpec


def check_job(spec: JobSpec, *, source: str = "job spec", before_launch: bool = False, run_dir: Path | None = None,
              ignore_rules: frozenset[str] = frozenset(), skip_records: str | None = None,
              resume_fallback: bool = True, continue_with_changes: bool = False) -> CheckedJob:
    """The checked job of a validated `spec`. `before_launch`: also the pre-launch pass of `dsmt train`
    (toolkit/check/dryrun.py: the model built on the meta device, DeepSpeed's parse, data and tokenizer, run
    identity), with `run_dir`'s files compared with the spec there, whose ds_config.json the job then holds (else
    the generated config). `ignore_rules`: problems the caller answers itself (`toolkit.api.initialize`: no data
    section, the script brings its batches). `skip_records`: why the data's records are not formatted here (a rank
    whose data_check.json verified them, `rank_job`; toolkit/check/data_checks.py check_data)."""
    from toolkit.check.checks import run_checks

    report, deepspeed_config = run_checks(spec=spec, source=source, skip_records=skip_records), None
    if before_launch:
        from toolkit.check.dryrun import prelaunch_pass

        report, deepspeed_config = prelaunch_pass(spec=spec, report=report, source=f"{source} (dsmt train --dry-run)",
                                                  spec_ref=source, run_dir=run_dir, allow_changes=continue_with_changes)
    report = Report(source=report.source, problems=tuple(p for p in report.problems if p.rule not in ignore_rules))
    if not report.ok:
        raise SpecError(report)
    return job_of(spec=spec, report=report, run_dir=run_dir, deepspeed_config=deepspeed_config,
                  resume_fallback=resume_fallback, continue_with_changes=continue_with_changes)


def check_job_file(path: str | Path, *, overrides: list[str] | tuple[str, ...] = (), **options) -> CheckedJob:
    """`check_job` of the spec in `path` with `overrides` (`--set`), read once; SpecError when it does not
    validate."""
    from toolkit.spec.load import load_spec

    return check_job(load_spec(path, overrides=overrides), source=str(path), **options)


def job_of(*, spec: JobSpec, report: Report, run_dir: Path | None = None,
           deepspeed_config: Mapping[str, Any] | None = None, **options) -> CheckedJob:
    """The job of a spec whose report has no errors: its layout, model facts and DeepSpeed config derived once."""
    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import model_shape

    layout = derive_layout(spec)
    try:
        model = model_shape(spec.model)
    except DsmtError:  # an HF model that is not a transformer LM (ResNet): the plain checks passed it
        model = None
    if deepspeed_config is None:
        deepspeed_config = build_deepspeed_config(spec=spec, layout=layout)
    return CheckedJob(spec=spec, layout=layout, model=model, deepspeed_config=deepspeed_config, report=report,
                      run_dir=run_dir, **options)


def rank_job(*, config: str | None, overrides: list[str] | tuple[str, ...], run_dir: Path | None,
             **options) -> CheckedJob:
    """A rank's checked job (`python -m toolkit.train`): `dsmt check`'s checks of `config` (default: the run
    directory's job.resolved.yaml), then the run directory's files compared with the spec (a contradiction stops
    here, before any process group, model or output file) and its ds_config.json taken. The data's records are
    not formatted again where the head's data_check.json verifies them (`verified_records`)."""
    import dataclasses
    import os

    from toolkit.spec.load import load_spec
    from toolkit.train.job.run_files import compare_run_files, spec_path_for

    config = spec_path_for(config=config, run_dir=run_dir, overrides=overrides)
    try:
        spec = load_spec(config, overrides=overrides)
        verified = verified_records(spec=spec, run_dir=run_dir)
        job = check_job(spec, source=str(config), skip_records=verified, **options)
    except SpecError as err:
        raise DsmtError(f"job spec {config} does not pass `dsmt check`:\n{err.report.to_text()}") from None
    if verified is not None and os.environ.get("RANK", "0") == "0":
        print(f"dsmt train: data records checked before launch: {verified}", flush=True)
    if run_dir is None:
        return job
    run_files = compare_run_files(run_dir=run_dir, spec=job.spec).require_agreement(spec_ref=str(config))
    if os.environ.get("RANK", "0") == "0":  # the launcher's rank; one copy of the report
        print("\n".join(run_files.start_lines()), flush=True)
    return dataclasses.replace(job, deepspeed_config=run_files.ds_config, run_dir=run_dir)


def verified_records(*, spec: JobSpec, run_dir: Path | None) -> str | None:
    """What stands in for formatting every record on this rank: the head's data_check.json (in the run directory,
    else the output directory, where `dsmt train`'s launcher writes it; toolkit/data/check_digest.py) verified
    against the files; None when no digest applies (the records are checked here, as `dsmt check` does). Raises
    DataChangedError when a checked file has changed since. The digest is sound wherever it is found: it applies
    only to the same data section, dsmt and record-check version, and only to files whose content it matches."""
    from toolkit.data.check_digest import digest_directory, verify_digest

    directory = digest_directory(run_dir=run_dir, output_dir=spec.training.output_dir)
    return verify_digest(data=spec.data, directory=directory)
