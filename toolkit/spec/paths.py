"""Where a spec's relative paths point: a path written in a spec file is relative to that file's folder (as
docker-compose and Hydra configs read theirs), a path given with `--set` to the working directory it was typed in.

Pinned on the raw mapping, before validation, so that every reader of the spec (check, dry run, the launcher,
each rank, `dsmt generate`'s resolved copy) sees the same absolute paths. A value that names no local path is
left alone where it has another meaning: a dataset name in the Hugging Face cache (`data.path: tatsu-lab/alpaca`),
or a built-in model shape (`model.path: llama3-8b`, taken as `model.builtin`). A model.path that is both a
built-in shape and a folder is refused: dsmt would have to guess which one the user meant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.errors import Problem, Report, SpecError
from toolkit.spec.preference import REFERENCE_KINDS

# (section, key) of the single-path settings; data.blend and data.mix hold lists of them.
PATH_KEYS = (("data", "tokenizer"), ("data", "cache_dir"), ("data", "validation_path"), ("training", "output_dir"))


def pin_spec_paths(raw: dict[str, Any], *, base_dir: Path, source: str) -> dict[str, Any]:
    """`raw` with each relative path made absolute against `base_dir` (in place; returned for chaining)."""
    _pin_model_path(raw, base_dir=base_dir, source=source)
    for section, key in PATH_KEYS:
        _pin_key(raw.get(section), key, base_dir=base_dir)
    data = raw.get("data")
    if isinstance(data, dict):
        for source in (data, *(data.get("mix") or ())):
            _pin_key(source, "path", base_dir=base_dir, may_be_dataset_name=True)
        blend = data.get("blend")
        if isinstance(blend, list):
            data["blend"] = [[entry[0], _pinned(entry[1], base_dir=base_dir)]
                             if isinstance(entry, (list, tuple)) and len(entry) == 2 else entry for entry in blend]
    training = raw.get("training")
    if isinstance(training, dict):
        _pin_key(training.get("lora"), "init_adapter", base_dir=base_dir)
        dpo = training.get("dpo")
        if isinstance(dpo, dict) and dpo.get("reference") not in (None, *REFERENCE_KINDS):
            _pin_key(dpo, "reference", base_dir=base_dir)  # a checkpoint path, as model.path
    return raw


def _pin_key(section: Any, key: str, *, base_dir: Path, may_be_dataset_name: bool = False) -> None:
    if isinstance(section, dict) and isinstance(section.get(key), str):
        section[key] = _pinned(section[key], base_dir=base_dir, may_be_dataset_name=may_be_dataset_name)


def _pinned(value: Any, *, base_dir: Path, may_be_dataset_name: bool = False) -> Any:
    """`value` against `base_dir`, unless absolute, `~`-relative, not a string, or (a data source) a name that is
    no local path and reads as a dataset's `org/name`."""
    from toolkit.spec.data_paths import looks_like_hub_id

    if not isinstance(value, str) or not value or value.startswith("~") or Path(value).is_absolute():
        return value
    candidate = base_dir / value
    if may_be_dataset_name and not candidate.exists() and looks_like_hub_id(value):
        return value  # an `org/name` dataset in the local HF cache; the loader says when it is neither
    return str(candidate.resolve())


def _pin_model_path(raw: dict[str, Any], *, base_dir: Path, source: str) -> None:
    from toolkit.models.shapes import BUILTIN_SHAPES

    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("path"), str):
        return
    value = model["path"]
    if value not in BUILTIN_SHAPES:
        model["path"] = _pinned(value, base_dir=base_dir)
        return
    folder = base_dir / value
    if folder.exists():
        raise SpecError(Report(source=source, problems=(Problem(
            "error", "model_path_ambiguous",
            f"model.path={value} names both the built-in shape {value} and the folder {folder.resolve()}",
            f"write model.path: ./{value} (or {folder.resolve()}) for the folder, or model.builtin: {value} for the "
            "built-in shape"),)))
    if "builtin" not in model:  # a shape name with no such folder: the built-in shape, said as such everywhere
        model["builtin"] = model.pop("path")


def output_dir_problems(*, output_dir: str) -> list[Problem]:
    """training.output_dir usable as a directory: not a file, nor under one. `dsmt train` makes it (and its run
    lock, `.dsmt-run.lock`) only after the checks, so this is the check's to say, not a traceback's."""
    path = Path(output_dir).expanduser()
    # the nearest existing part of the path: a path under a file does not exist (ENOTDIR), the file does
    blocker = next((part for part in (path, *path.parents) if part.exists()), None)
    if blocker is None or blocker.is_dir():
        return []
    where = "is a file" if blocker == path else f"is inside {blocker}, which is a file"
    return [Problem("error", "output_dir_not_a_directory",
                    f"training.output_dir={output_dir} {where}: dsmt train writes its checkpoints, logs and run lock "
                    "into a directory there",
                    f"set training.output_dir to a directory (a new one is made), or move the file {blocker} away")]
