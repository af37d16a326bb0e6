"""`dsmt train`'s pre-launch pass: the checks of `dsmt train --dry-run` (toolkit/check/dryrun.py), run before
the run lock is taken, the output directory made or a rank started; a failure is exit 2 with nothing written.

It runs in the launcher's own process, which then waits on its ranks for the whole run. On a GPU node that
process holds the libraries the pass imported (torch, megatron-core, DeepSpeed, transformers: about 1 GB of host
memory) but no GPU state: the model is built on the meta device with CPU initialisation and the pass only asks
whether CUDA is there. (A forked child would free that memory, but fork in a process with threads, such as a
script calling `toolkit.api.train`, can deadlock; a spawned one pays the imports twice.)"""

from __future__ import annotations

import time
from pathlib import Path

from toolkit.errors import Report, SpecError
from toolkit.spec.checked import CheckedJob
from toolkit.spec.schema import JobSpec


def refuse_a_running_run(*, spec: JobSpec) -> None:
    """RunLocked (exit 2) at once when a live run trains into the spec's output directory: the pass below takes
    seconds, and a second `dsmt train` of the same job is a mistake too."""
    from toolkit.launch import run_lock

    output_dir = Path(spec.training.output_dir)
    if not output_dir.expanduser().is_dir():
        return  # no run there yet, or a file in the way: the pass names it (output_dir_not_a_directory)
    run_lock.refuse_if_held(output_dir=output_dir)


def refuse_another_job(*, spec: JobSpec, allow_changes: bool) -> None:
    """DsmtError `another_run_in_output_dir` at once when the spec would continue another job's checkpoints
    (toolkit/train/job/run_identity.py): a mistake the pass below would name only after its seconds of work."""
    from toolkit.train.job import run_identity

    run_identity.check(spec=spec, allow_changes=allow_changes)


def checked_file_before_launch(*, path: str, overrides, run_dir: Path | None, allow_changes: bool = False,
                               resume_fallback: bool = True) -> CheckedJob:
    """`checked_before_launch` of the spec in `path` with `overrides`, the file read once."""
    from toolkit.spec.load import load_spec

    try:
        spec = load_spec(path, overrides=overrides)
    except SpecError as err:
        raise _nothing_started(err.report, source=path) from None
    return checked_before_launch(spec=spec, source=path, run_dir=run_dir, allow_changes=allow_changes,
                                 resume_fallback=resume_fallback)


def checked_before_launch(*, spec: JobSpec, source: str, run_dir: Path | None = None, allow_changes: bool = False,
                          resume_fallback: bool = True) -> CheckedJob:
    """The checked job, once the pass finds no error; else SpecError listing the errors and warnings (RunLocked
    first, when a live run holds the output directory). `source` names the spec in messages."""
    from toolkit.check.job import check_job

    refuse_a_running_run(spec=spec)
    refuse_another_job(spec=spec, allow_changes=allow_changes)
    started = time.monotonic()
    try:
        job = check_job(spec, source=source, before_launch=True, run_dir=run_dir,
                        continue_with_changes=allow_changes, resume_fallback=resume_fallback)
    except SpecError as err:
        raise _nothing_started(err.report, source=source) from None
    print(f"dsmt train: pre-launch checks passed in {time.monotonic() - started:.1f} s "
          f"(`dsmt train {source} --dry-run` lists what they found)", flush=True)
    return job


def _nothing_started(report: Report, *, source: str) -> SpecError:
    shown = tuple(p for p in report.problems if p.severity != "info")
    return SpecError(Report(source=f"{source}: nothing was started; `dsmt train --dry-run` finds the same",
                            problems=shown))
