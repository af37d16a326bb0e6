"""Validation records: `data.validation_path`, or a share of `data.path` held out (`data.validation_fraction`).

Both sides go through the same stages (toolkit/data/pipeline.py), each side on its own (a held-out record never
shares an example with a training one), and cached apart (`toolkit.data.cache`, key part "train" / "validation").

* `validation_path`: a file (or save_to_disk directory) read like `data.path` (same `data.format`, `data.split`),
  that must hold the fields the record kind reads (`required_fields`); the training records are all of `data.path`.
* `validation_fraction = f` of the `N` records of `data.path`: `num_validation = round(N * f)` records, the first
  `num_validation` entries of `torch.randperm(N)` drawn from `torch.Generator().manual_seed(training.seed)`, are
  held out; both sides keep the original record order (the order packing fills rows in). Both sides must get
  at least one record. A hub dataset id is not accepted as validation_path: give a local file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

TRAIN, VALIDATION = "train", "validation"
PARTS = (TRAIN, VALIDATION)


class ValidationDataError(DsmtError):
    """The validation data cannot be read, or does not fit the training data."""

    rule = "validation_data"  # the `dsmt check` / dry-run rule name


class ValidationPathMissingError(ValidationDataError):
    rule = "validation_path_missing"


class ValidationFieldsError(ValidationDataError):
    rule = "validation_fields"


class ValidationFractionError(ValidationDataError):
    rule = "validation_fraction_empty"


def has_validation(data: DataSpec) -> bool:
    return data.validation_path is not None or data.validation_fraction is not None


@dataclasses.dataclass(frozen=True)
class RecordSplit:
    """Which records of `data.path` each side gets (`validation_fraction`): indices in record order."""

    train: list[int]
    validation: list[int]

    def describe(self, *, fraction: float, seed: int) -> str:
        total = len(self.train) + len(self.validation)
        return (f"data.validation_fraction={fraction} of {total} records (seed {seed}): {len(self.train)} for "
                f"training, {len(self.validation)} held out for validation")


def split_records(*, num_records: int, fraction: float, seed: int) -> RecordSplit:
    """The held-out records: see the module docstring. Raises when a side would be empty."""
    num_validation = round(num_records * fraction)
    if num_validation == 0 or num_validation == num_records:
        side = "validation" if num_validation == 0 else "training"
        smallest = 1 / num_records if num_records else 1
        raise ValidationFractionError(
            f"validation_fraction_empty: data.validation_fraction={fraction} of {num_records} records leaves "
            f"{num_validation} validation and {num_records - num_validation} training records: no {side} record; "
            f"use a fraction between {smallest:.3g} and {1 - smallest:.3g}, or give data.validation_path")
    order = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed))
    held_out = sorted(order[:num_validation].tolist())
    kept = sorted(order[num_validation:].tolist())
    return RecordSplit(train=kept, validation=held_out)


def validation_spec(data: DataSpec) -> DataSpec:
    """`data` reading the validation file as its records (same record kind, fields and format)."""
    return data.model_copy(update={"path": data.validation_path, "validation_path": None,
                                   "validation_fraction": None})


def load_validation_file(*, data: DataSpec, cache_dir: str | None = None):
    """The records of `data.validation_path` (a local file or save_to_disk directory), checked to hold the fields
    the record kind reads and to be non-empty."""
    from toolkit.data import sources
    from toolkit.data.records import record_type, required_fields

    path = Path(data.validation_path).expanduser()
    expected = required_fields(data)
    if not path.exists():
        raise ValidationPathMissingError(
            f"validation_path_missing: data.validation_path={data.validation_path!r} does not exist (looked in "
            f"{Path.cwd()}); give a file of the same kind as data.path={data.path!r} with the field(s) "
            f"{', '.join(expected)}, or use data.validation_fraction to hold out part of data.path")
    spec = validation_spec(data)
    try:  # the loaders of load_records, without its check that names data.path
        records = (sources._load_directory(path=path, data=spec) if path.is_dir()
                   else sources._load_file(path=path, data=spec, cache_dir=cache_dir))
    except DsmtError as err:
        raise ValidationDataError(f"data.validation_path={data.validation_path!r}: {err}") from err
    found = list(records.column_names)
    if any(name not in found for name in expected):
        raise ValidationFieldsError(
            f"validation_fields: data.validation_path={data.validation_path!r} has the field(s) "
            f"{', '.join(found) or '(none)'}, but the training data (data.path={data.path!r}, data.type "
            f"{record_type(data)}) reads {', '.join(expected)}; give validation records of the same kind and "
            f"fields")
    if len(records) == 0:
        raise ValidationDataError(f"data.validation_path={data.validation_path!r} (split {data.split!r}) has no "
                                  "records; give a non-empty file")
    return records


def part_records(*, data: DataSpec, part: str, seed: int, cache_dir: str | None = None):
    """The raw records of one side: `part` is "train" or "validation" (see the module docstring)."""
    from toolkit.data.sources import load_records

    if part not in PARTS:
        raise DsmtError(f"data part {part!r} is not one of {', '.join(PARTS)}")
    if part == VALIDATION and data.validation_path is not None:
        return load_validation_file(data=data, cache_dir=cache_dir)
    if part == VALIDATION and data.validation_fraction is None:
        raise DsmtError("there is no validation data: set data.validation_path or data.validation_fraction")
    records = load_records(data=data, cache_dir=cache_dir)
    if data.validation_fraction is None:
        return records
    split = split_records(num_records=len(records), fraction=data.validation_fraction, seed=seed)
    if part == VALIDATION:  # once per job: rank 0 (it tokenises both sides when the cache has neither; the task
        import torch.distributed as dist  # examples of toolkit/data/tasks.py are read on every rank)

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"dsmt data: {split.describe(fraction=data.validation_fraction, seed=seed)}", flush=True)
    return records.select(split.train if part == TRAIN else split.validation)


def key_inputs(*, data: DataSpec, part: str, seed: int) -> dict:
    """What the cache key of `part` adds to the training key: nothing for training data without a held-out share
    (so existing caches stay valid), else the part, the split seed and the validation file's identity."""
    from toolkit.data.sources import source_identity

    if part == TRAIN and data.validation_fraction is None:
        return {}
    inputs: dict = {"part": part}
    if data.validation_fraction is not None:
        inputs["split_seed"] = seed
    if part == VALIDATION and data.validation_path is not None:
        inputs["validation_source"] = source_identity(data.validation_path)
    return inputs


def describe_source(data: DataSpec) -> str:
    if data.validation_path is not None:
        return f"data.validation_path={data.validation_path}"
    return f"data.validation_fraction={data.validation_fraction} of data.path={data.path}"
