"""The source stage: `data.path` read into a `datasets.Dataset` of raw records (no formatting, no tokens).

Accepted sources, decided in this order:
  * a directory written by `save_to_disk`: `datasets.load_from_disk` (a `DatasetDict` gives up `data.split`);
  * any other directory is a dataset repository folder as `huggingface-cli download --repo-type dataset` leaves
    it: `datasets.load_dataset(folder, name=data.config, split=data.split)`, which takes the splits from the file
    names (`data/train-00000-of-00001.parquet`, `test.jsonl`) or from the README's `configs`;
  * a file: `datasets.load_dataset(<builder>, data_files=...)`, the builder from `data.format` or, for
    `format="auto"`, from the extension (`FILE_BUILDERS`); `.gz/.bz2/.xz/.zst` wrappers are looked through;
  * anything else shaped like a hub id (`owner/name`): with `HF_HUB_OFFLINE=1`, the snapshot the hub CLI left in
    the local Hugging Face cache, read as a repository folder (else `datasets`' own cache of an earlier
    `load_dataset`); online, `datasets.load_dataset(name)`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

from toolkit.data.files import (COMPRESSION_SUFFIXES, SAVE_TO_DISK_MARKERS, bad_json_line, file_suffix,
                                 is_save_to_disk_dir)
from toolkit.data.records import record_type, required_fields
from toolkit.errors import DsmtError
from toolkit.spec.data_paths import FILE_BUILDERS, FORMAT_BUILDERS, looks_like_hub_id
from toolkit.spec.data_schema import RecordSource


def load_records(*, data: RecordSource, cache_dir: str | None = None):
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
    elif looks_like_hub_id(data.path):
        records = _load_hub(name=data.path, data=data, cache_dir=cache_dir)
    else:
        raise DsmtError(
            f"data.path={data.path!r} does not exist (looked in {Path.cwd()}); give a "
            f"{'/'.join(e.lstrip('.') for e in FILE_BUILDERS)} file or a save_to_disk directory"
        )
    _check_records(records=records, data=data)
    return records


def _builder_for(*, path: Path, data: RecordSource) -> str:
    if data.format != "auto":
        return FORMAT_BUILDERS[data.format]
    suffix = file_suffix(path)
    if suffix not in FILE_BUILDERS:
        valid = ", ".join(FILE_BUILDERS)
        raise DsmtError(
            f"data.path={str(path)!r}: extension {suffix or '(none)'!r} is not a known data format; valid: {valid} "
            f"(optionally compressed: {', '.join(COMPRESSION_SUFFIXES)}), a save_to_disk directory, or set "
            f"data.format to one of {', '.join(FORMAT_BUILDERS)}"
        )
    return FILE_BUILDERS[suffix]


def _load_file(*, path: Path, data: RecordSource, cache_dir: str | None):
    import datasets

    builder = _builder_for(path=path, data=data)
    if path.stat().st_size == 0:  # the builders fail obscurely (StopIteration) on an empty file
        raise DsmtError(f"data.path={str(path)!r} is an empty file; give a non-empty dataset")
    # A single file becomes whichever split the spec asks for, so `split: validation` or `train[:90%]` both work.
    split_name = data.split.split("[", 1)[0] or "train"
    # The json builder logs pyarrow's parse error (rows counted from 0, blank lines skipped) before it raises; the
    # error below names the file's line instead, which that log line would contradict.
    try:
        with quieted_logger("datasets.packaged_modules.json.json", level=logging.CRITICAL):
            return datasets.load_dataset(builder, data_files={split_name: str(path)}, split=data.split,
                                         cache_dir=cache_dir)
    except Exception as err:
        raise _unreadable_file(err, path=path, data=data, builder=builder) from err


@contextlib.contextmanager
def quieted_logger(name: str, *, level: int):
    """The logger `name` says only records of `level` and above inside the block; its own level again after."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _unreadable_file(err: Exception, *, path: Path, data: RecordSource, builder: str) -> DsmtError:
    """The builder's failure on `path` as one line naming the cause and the fix (the bad line of a JSON file)."""
    if isinstance(err, ValueError) and "corresponds to no data" in str(err):  # a header-only csv, an empty slice
        return DsmtError(f"data.path={str(path)!r} (split {data.split!r}) has no records; give a non-empty dataset")
    bad_line = bad_json_line(path) if builder == "json" and not isinstance(err, OSError) else None
    if bad_line is not None:
        return RecordsError(rule="data_json_line", message=f"data.path={str(path)!r}: {bad_line}")
    if isinstance(err, (ValueError, TypeError, OSError)):
        return DsmtError(f"data.path={str(path)!r} could not be read as {builder}: {err}")
    # the builders raise their own types (pyarrow, DatasetGenerationError) for bad content
    cause = err.__cause__ or err  # DatasetGenerationError's own text says only that generating failed
    return DsmtError(f"data.path={str(path)!r} could not be read as {builder} ({type(cause).__name__}: "
                     f"{' '.join(str(cause).split())}); check the file's content matches its extension")


def _load_directory(*, path: Path, data: RecordSource):
    import datasets

    if not is_save_to_disk_dir(path):
        return _load_repository_folder(path=path, data=data)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # `datasets` fails on some directories it wrote itself (an empty dataset: IndexError)
        raise DsmtError(f"data.path={str(path)!r}: datasets.load_from_disk failed ({type(err).__name__}: {err}); "
                        f"re-save it with save_to_disk, or export it to a jsonl file") from err
    if isinstance(loaded, datasets.DatasetDict):
        if data.split not in loaded:
            raise DsmtError(f"data.split={data.split!r} is not in {str(path)!r}; available splits: "
                            f"{', '.join(loaded)} (slicing like train[:10%] works for files only)")
        return loaded[data.split]
    return loaded


def _load_repository_folder(*, path: Path, data: RecordSource, what: str = "data.path"):
    """A dataset repository folder: splits from file names or the README's `configs` (`datasets`' own rules)."""
    import datasets

    found = sorted(str(f.relative_to(path)) for f in path.rglob("*")
                   if f.is_file() and file_suffix(f) in FILE_BUILDERS and ".cache" not in f.parts)
    if not found:
        raise DsmtError(f"{what}={str(path)!r} is a directory but neither a datasets.save_to_disk output (no "
                        f"{' / '.join(SAVE_TO_DISK_MARKERS)}) nor a dataset repository folder (no "
                        f"{'/'.join(e.lstrip('.') for e in FILE_BUILDERS)} files in it); point at the folder the "
                        f"hub CLI downloaded, a save_to_disk output or a data file")
    try:
        return datasets.load_dataset(str(path), name=data.config, split=data.split)
    except ValueError as err:  # unknown split / config: `datasets` lists the valid ones in its message
        raise DsmtError(f"{what}={str(path)!r} (a dataset repository folder with {', '.join(found[:4])}"
                        f"{' ...' if len(found) > 4 else ''}): data.split={data.split!r}, data.config="
                        f"{data.config!r}: {err}; set data.split / data.config to one it has") from err
    except Exception as err:
        raise DsmtError(f"{what}={str(path)!r}: reading it as a dataset repository folder failed "
                        f"({type(err).__name__}: {err}); check its files and README configs") from err


def hub_offline() -> bool:
    """`datasets`' own reading of HF_DATASETS_OFFLINE / HF_HUB_OFFLINE (the hub's, unless the first is set)."""
    import datasets.config

    return bool(datasets.config.HF_HUB_OFFLINE)


def cached_snapshot(name: str) -> Path | None:
    """The newest snapshot of dataset repository `name` in the local Hugging Face hub cache, if one is there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=name, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def _load_hub(*, name: str, data: RecordSource, cache_dir: str | None):
    import datasets

    if hub_offline():
        snapshot = cached_snapshot(name)
        if snapshot is not None:
            return _load_repository_folder(path=snapshot, data=data, what=f"data.path={name!r} in the hub cache at")
    try:
        return datasets.load_dataset(name, name=data.config, split=data.split, cache_dir=cache_dir)
    except ConnectionError as err:  # `datasets` raises this for offline mode and unreachable hosts alike
        from huggingface_hub.constants import HF_HUB_CACHE

        raise DsmtError(
            f"data.path={name!r} is not a local file or directory, and it is not in the local Hugging Face cache "
            f"(hub cache {HF_HUB_CACHE}, datasets cache {cache_dir or datasets.config.HF_DATASETS_CACHE}) while "
            f"the hub is unreachable or HF_HUB_OFFLINE=1 ({err}); download it where there is network "
            f"(`huggingface-cli download --repo-type dataset {name}`) into the cache or a folder, and give that"
        ) from err
    except Exception as err:  # not found, gated, no such split: the hub answered, and said no
        raise DsmtError(f"data.path={name!r}: loading it as a hub dataset failed ({type(err).__name__}: {err}); "
                        f"check the name, data.config={data.config!r} and data.split={data.split!r}, or pass a "
                        f"local file") from err


class RecordsError(DsmtError):
    """Records that cannot train as the data section says; `rule` names why (as `dsmt check` reports it)."""

    def __init__(self, *, rule: str, message: str):
        self.rule = rule
        super().__init__(message)

    def __reduce__(self):  # keyword-only __init__: pickle (worker processes) through the keywords
        return functools.partial(RecordsError, rule=self.rule, message=str(self)), ()


def _check_records(*, records, data: RecordSource) -> None:
    present = list(records.column_names)
    missing = [name for name in required_fields(data) if name not in present]
    if missing:
        raise RecordsError(rule="record_missing_field", message=
            f"data.path={data.path!r} has no field {', '.join(repr(m) for m in missing)}, "
            f"which data.type={record_type(data)} reads; fields present: {', '.join(present) or '(none)'}; set "
            f"data.type to the records' type (text, completion, alpaca, sharegpt, messages), or data.text_field, "
            f"data.prompt_field/completion_field or data.messages_field to one of the fields present"
        )
    if len(records) == 0:
        raise RecordsError(rule="data_empty", message=f"data.path={data.path!r} (split {data.split!r}) has no "
                           "records; give a non-empty dataset")


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
    snapshot = cached_snapshot(path_text) if hub_offline() and looks_like_hub_id(path_text) else None
    if snapshot is not None:  # the revision the hub cache holds now
        return [["hub", path_text], *source_identity(str(snapshot))[1:]]
    return [["hub", path_text]]  # not local: load_records decides whether it is a hub id
