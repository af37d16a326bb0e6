"""A job that passed its checks: what every runner takes (`dsmt generate`, `dsmt train`'s launcher, a rank,
`toolkit.api`), so that none of them re-reads a file, re-runs a check or takes a `checked` flag on trust.

Built only by toolkit/check/job.py (the checks sit above everything they check; this type sits low so that the
runners below the checks can take it). Immutable all the way down (its DeepSpeed config too): a runner that needs another job asks the checks again."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any, Mapping

from toolkit.errors import Report
from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import RunLayout
from toolkit.spec.schema import JobSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckedJob:
    spec: JobSpec  # validated, every relative path absolute
    layout: RunLayout  # the parallel layout and batch arithmetic the ranks run with
    model: ModelShape | None  # the model's facts; None for an HF model that is not a transformer LM (ResNet)
    deepspeed_config: Mapping[str, Any]  # what DeepSpeed receives: generated, or a run directory's (read-only)
    report: Report  # everything the checks found (no errors; warnings and notes)
    run_dir: Path | None = None  # the `dsmt generate` directory whose ds_config.json the run uses, if any
    # How a run continues what its output directory holds: resume from the newest intact checkpoint when the newest
    # is damaged (False: `--no-fallback`, stop); accept the changes run identity allows (`--continue-with-changes`).
    resume_fallback: bool = True
    continue_with_changes: bool = False

    def __post_init__(self):
        if not self.report.ok:
            raise ValueError("a CheckedJob holds a report without errors (toolkit/check/job.py raises SpecError first)")
        object.__setattr__(self, "deepspeed_config", _frozen(self.deepspeed_config))
        if self.run_dir is not None:  # the ranks are handed it: absolute, whatever directory they start in
            object.__setattr__(self, "run_dir", Path(self.run_dir).expanduser().absolute())

    def ds_config(self) -> dict:
        """A fresh, editable copy of the DeepSpeed config, for a library that edits what it is given
        (deepspeed.initialize pops its optimizer's own keys)."""
        return _thawed(self.deepspeed_config)


def _frozen(value):
    """`value` read-only all the way down: mappings as MappingProxyType, lists as tuples."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def _thawed(value):
    """The plain dicts and lists of a `_frozen` value (what json.dump and DeepSpeed expect)."""
    if isinstance(value, Mapping):
        return {key: _thawed(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thawed(item) for item in value]
    return value
