"""Reading `data.path` into a `datasets.Dataset` of raw records (no tokenisation here).

Accepted sources, decided in this order:
  * a directory: `datasets.load_from_disk` (a `DatasetDict` gives up `data.split`);
  * a file: `datasets.load_dataset(<builder>, data_files=...)`, the builder from `data.format` or, for
    `format="auto"`, from the extension (`FILE_BUILDERS`); `.gz/.bz2/.xz/.zst` wrappers are looked through;
  * anything else shaped like a hub id (`owner/name`): `datasets.load_dataset(name)`, which needs the network; when
    the hub cannot be reached the error says so and asks for a local file.
"""

from __future__ import annotations

import re
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

# Extension -> `datasets` packaged builder. `.json` is handled by the json builder whether it holds JSON lines or
# one top-level list of records.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                 ".arrow": "arrow"}
# `data.format` -> builder, for files whose extension says nothing useful.
FORMAT_BUILDERS = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "text": "text",
                   "arrow": "arrow"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
# A hub dataset id: `name` or `owner/name`, letters, digits, '-', '_', '.'; no extension we know as a file.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def required_fields(*, data: DataSpec) -> list[str]:
    """The record columns the tokenizer will read, for the record kind `data` selects."""
    if data.messages_field is not None:
        return [data.messages_field]
    if data.prompt_field is not None:
        return [data.prompt_field, data.completion_field]
    return [data.text_field]


def load_records(*, data: DataSpec, cache_dir: str | None = None):
    """Load the raw records of `data.path` (split `data.split`) as a `datasets.Dataset`, checked non-empty and
    holding every field the record kind needs. `cache_dir` is the `datasets` cache (None: its default)."""
    if data.path is None:
        raise DsmtError("data.path is not set: load_records needs a file or directory "
                        "(data.synthetic: true uses synthetic_examples instead)")
    path = Path(data.path).expanduser()
    if path.is_dir():
        records = _load_directory(path=path, data=data)
    elif path.is_file():
        records = _load_file(path=path, data=data, cache_dir=cache_dir)
    elif _looks_like_hub_id(data.path):
        records = _load_hub(name=data.path, data=data, cache_dir=cache_dir)
    else:
        raise DsmtError(
            f"data.path={data.path!r} does not exist (looked in {Path.cwd()}); give a "
            f"{'/'.join(e.lstrip('.') for e in FILE_BUILDERS)} file or a save_to_disk directory"
        )
    _check_records(records=records, data=data)
    return records


def _looks_like_hub_id(text: str) -> bool:
    # A path with a known file extension, or one that starts like a filesystem path, is a missing local file.
    if text.startswith((".", "/", "~")) or _file_suffix(Path(text)) in FILE_BUILDERS:
        return False
    return bool(HUB_ID_RE.match(text))


def _file_suffix(path: Path) -> str:
    """The extension that says the format, looking through one compression suffix (`a.jsonl.gz` -> `.jsonl`)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _builder_for(*, path: Path, data: DataSpec) -> str:
    if data.format != "auto":
        return FORMAT_BUILDERS[data.format]
    suffix = _file_suffix(path)
    if suffix not in FILE_BUILDERS:
        valid = ", ".join(FILE_BUILDERS)
        raise DsmtError(
            f"data.path={str(path)!r}: extension {suffix or '(none)'!r} is not a known data format; valid: {valid} "
            f"(optionally compressed: {', '.join(COMPRESSION_SUFFIXES)}), a save_to_disk directory, or set "
            f"data.format to one of {', '.join(FORMAT_BUILDERS)}"
        )
    return FILE_BUILDERS[suffix]


def _load_file(*, path: Path, data: DataSpec, cache_dir: str | None):
    import datasets

    builder = _builder_for(path=path, data=data)
    if path.stat().st_size == 0:  # the builders fail obscurely (StopIteration) on an empty file
        raise DsmtError(f"data.path={str(path)!r} is an empty file; give a non-empty dataset")
    # A single file becomes whichever split the spec asks for, so `split: validation` or `train[:90%]` both work.
    split_name = data.split.split("[", 1)[0] or "train"
    try:
        return datasets.load_dataset(builder, data_files={split_name: str(path)}, split=data.split,
                                     cache_dir=cache_dir)
    except ValueError as err:
        if "corresponds to no data" in str(err):  # a csv with a header only, a split slice of nothing
            raise DsmtError(f"data.path={str(path)!r} (split {data.split!r}) has no records; give a non-empty "
                            f"dataset") from err
        raise DsmtError(f"data.path={str(path)!r} could not be read as {builder}: {err}") from err
    except (TypeError, OSError) as err:
        raise DsmtError(f"data.path={str(path)!r} could not be read as {builder}: {err}") from err
    except Exception as err:  # the builders raise their own types (pyarrow, DatasetGenerationError) for bad content
        raise DsmtError(f"data.path={str(path)!r} could not be read as {builder} "
                        f"({type(err).__name__}: {err}); check the file's content matches its extension") from err


def _load_directory(*, path: Path, data: DataSpec):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DsmtError(f"data.path={str(path)!r} is a directory but not a datasets.save_to_disk output "
                        f"({err}); point at a data file or the directory save_to_disk wrote") from err
    except Exception as err:  # `datasets` fails on some directories it wrote itself (an empty dataset: IndexError)
        raise DsmtError(f"data.path={str(path)!r}: datasets.load_from_disk failed ({type(err).__name__}: {err}); "
                        f"re-save it with save_to_disk, or export it to a jsonl file") from err
    if isinstance(loaded, datasets.DatasetDict):
        if data.split not in loaded:
            raise DsmtError(f"data.split={data.split!r} is not in {str(path)!r}; available splits: "
                            f"{', '.join(loaded)} (slicing like train[:10%] works for files only)")
        return loaded[data.split]
    return loaded


def _load_hub(*, name: str, data: DataSpec, cache_dir: str | None):
    import datasets

    try:
        return datasets.load_dataset(name, split=data.split, cache_dir=cache_dir)
    except ConnectionError as err:  # `datasets` raises this for offline mode and unreachable hosts alike
        raise DsmtError(
            f"data.path={name!r} is not a local file or directory, so it was tried as a Hugging Face hub dataset, "
            f"but the network/hub is unreachable ({err}); pass a local jsonl/json/csv/parquet/txt file or a "
            f"save_to_disk directory as data.path"
        ) from err
    except Exception as err:  # not found, gated, no such split: the hub answered, and said no
        raise DsmtError(f"data.path={name!r}: loading it as a hub dataset failed ({type(err).__name__}: {err}); "
                        f"check the name and data.split={data.split!r}, or pass a local file") from err


def _check_records(*, records, data: DataSpec) -> None:
    present = list(records.column_names)
    missing = [name for name in required_fields(data=data) if name not in present]
    if missing:
        raise DsmtError(
            f"data.path={data.path!r} has no field {', '.join(repr(m) for m in missing)}; fields present: "
            f"{', '.join(present) or '(none)'}; set data.text_field, data.prompt_field/completion_field or "
            f"data.messages_field to one of them"
        )
    if len(records) == 0:
        raise DsmtError(f"data.path={data.path!r} (split {data.split!r}) has no records; give a non-empty dataset")


def source_identity(path_text: str) -> list:
    """[relative name, size, mtime_ns] of the file, or of every file under a save_to_disk directory."""
    path = Path(path_text).expanduser()
    if path.is_file():
        stat = path.stat()
        return [[str(path.resolve()), stat.st_size, stat.st_mtime_ns]]
    if path.is_dir():
        found = [[str(path.resolve())]]
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            stat = file.stat()
            found.append([str(file.relative_to(path)), stat.st_size, stat.st_mtime_ns])
        return found
    return [["hub", path_text]]  # not local: load_records decides whether it is a hub id
