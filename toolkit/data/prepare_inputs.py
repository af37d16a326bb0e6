"""The inputs of `dsmt data prepare` (toolkit/data/prepare.py), read as a stream of checked texts.

An input is one of:
  * a file: `datasets.load_dataset(<builder>, data_files=..., streaming=True)`, the builder from the extension
    (toolkit/spec/data_paths.py `FILE_BUILDERS`, looking through `.gz/.bz2/.xz/.zst`);
  * a `datasets.save_to_disk` directory (it has `state.json` or `dataset_dict.json`): `load_from_disk`, whose
    arrow files are memory-mapped, iterated in batches;
  * any other directory, as `huggingface-cli download --repo-type dataset` leaves a repository
    (`data/train-00000-of-00001.parquet`, a README with `configs`): `datasets.load_dataset(folder, streaming=True)`,
    which infers the splits from the file names and the README.
Nothing is read whole into memory. Records are numbered from 1 within their input; a jsonl file's errors also give
the line (the json reader skips blank lines, so the two can differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.data.files import COMPRESSION_SUFFIXES, file_suffix, is_save_to_disk_dir, line_numbers
from toolkit.spec.data_paths import FILE_BUILDERS
from toolkit.errors import DsmtError

# What `datasets`' builders expect, for the message when one fails. Its json reader falls back to pandas when a
# field changes type between records, and that fallback also chokes on blank lines ("Expected object or value").
FORMAT_SHAPES = {"json": "one JSON object per line (jsonl) or one JSON list of objects, each field keeping one type "
                         "(a text field of strings or null)",
                 "csv": "a header row naming the fields, then one comma-separated row per record",
                 "parquet": "a parquet table", "text": "UTF-8 text, one record per line",
                 "arrow": "an Arrow IPC stream"}


@dataclass(frozen=True)
class InputSource:
    path: Path  # resolved
    kind: str  # "file", "saved" (a save_to_disk directory) or "repo" (a dataset repository folder)
    builder: str | None = None  # a file's `datasets` packaged builder

    def describe(self) -> str:
        if self.kind == "file":
            return f"{self.builder} (from its extension)"
        return "a datasets.save_to_disk directory" if self.kind == "saved" else "a dataset repository folder"

    def fix(self) -> str:
        """What to check when `datasets` cannot read it."""
        if self.kind == "file":
            return f"check that it holds {FORMAT_SHAPES.get(self.builder, self.builder)}, as its extension says"
        if self.kind == "saved":
            return "check --split, or re-save it with save_to_disk"
        return ("check --split against its file names (data/<split>-00000-of-00001.parquet) or its README's "
                "configs, or give its data files as inputs")

    @property
    def is_jsonl(self) -> bool:
        return self.kind == "file" and file_suffix(self.path) == ".jsonl"


def resolve_inputs(*, inputs: list[str | Path]) -> list[InputSource]:
    """Every input checked to exist and to have a known kind, before anything is read or written."""
    if not inputs:
        raise DsmtError("no inputs: give one or more data files or directories")
    missing = [str(item) for item in inputs if not Path(item).expanduser().exists()]
    if missing:
        raise DsmtError(f"input {', '.join(missing)} does not exist (looked from {Path.cwd()}); give "
                        f"{'/'.join(e.lstrip('.') for e in FILE_BUILDERS)} files, a save_to_disk directory or a "
                        f"dataset repository folder")
    return [_source_of(Path(item).expanduser().resolve()) for item in inputs]


def _source_of(path: Path) -> InputSource:
    if path.is_dir():
        return InputSource(path=path, kind="saved" if is_save_to_disk_dir(path) else "repo")
    suffix = file_suffix(path)
    if suffix not in FILE_BUILDERS:
        raise DsmtError(f"input {path}: extension {suffix or '(none)'!r} is not a known data format; valid: "
                        f"{', '.join(FILE_BUILDERS)} (optionally compressed: {', '.join(COMPRESSION_SUFFIXES)}), "
                        f"a save_to_disk directory or a dataset repository folder; rename the file to say its format")
    return InputSource(path=path, kind="file", builder=FILE_BUILDERS[suffix])


def text_chunks(*, sources: list[InputSource], text_field: str, split: str, chunk_texts: int):
    """Lists of `chunk_texts` texts (the last one shorter), every input's records in order, each checked to hold a
    string in `text_field`."""
    chunk: list[str] = []
    for source in sources:
        for batch, first_record in _record_batches(source, split=split, batch_size=chunk_texts):
            chunk.extend(_checked_texts(batch, source=source, text_field=text_field, first_record=first_record))
            while len(chunk) >= chunk_texts:
                yield chunk[:chunk_texts]
                chunk = chunk[chunk_texts:]
    if chunk:
        yield chunk


def _record_batches(source: InputSource, *, split: str, batch_size: int):
    """(columns dict, number of its first record) per batch of `source`'s records, the reader's errors as
    DsmtError."""
    if source.kind == "file" and source.path.stat().st_size == 0:
        return  # no records (the builders fail obscurely on an empty file); zero documents overall is refused later
    iterator = iter(_open_records(source, split=split).iter(batch_size=batch_size))
    first_record = 1
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as err:  # pyarrow, json and the builders raise their own types for bad content
            raise DsmtError(f"input {source.path}: reading it as {source.describe()} failed after record "
                            f"{first_record - 1} ({type(err).__name__}: {err}); {source.fix()}") from err
        yield batch, first_record
        first_record += len(next(iter(batch.values()), []))


def _open_records(source: InputSource, *, split: str):
    import datasets

    try:
        if source.kind == "file":
            return datasets.load_dataset(source.builder, data_files={split: str(source.path)}, split=split,
                                         streaming=True)
        if source.kind == "repo":
            return datasets.load_dataset(str(source.path), split=split, streaming=True)
        loaded = datasets.load_from_disk(str(source.path))
    except Exception as err:  # bad content, a bad split, no data files in a folder, a damaged save_to_disk dir
        raise DsmtError(f"input {source.path}: opening it as {source.describe()} (--split {split!r}) failed "
                        f"({type(err).__name__}: {err}); {source.fix()}") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DsmtError(f"input {source.path}: --split {split!r} is not in this save_to_disk directory; "
                            f"its splits: {', '.join(loaded)}")
        loaded = loaded[split]
    return loaded


def _checked_texts(batch: dict, *, source: InputSource, text_field: str, first_record: int) -> list[str]:
    size = len(next(iter(batch.values()), []))
    texts = batch.get(text_field, [None] * size)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise _record_error(batch, index=index, source=source, text_field=text_field,
                                record=first_record + index)
    return texts


def _record_error(batch: dict, *, index: int, source: InputSource, text_field: str, record: int) -> DsmtError:
    line = line_numbers(path=source.path, indices=[record - 1]).get(record - 1) if source.is_jsonl else None
    where = f"input {source.path}: record {record}" + (f" (line {line})" if line is not None else "")
    value = batch[text_field][index] if text_field in batch else None
    if value is None:  # absent, or null (the json reader fills a field absent from this record with null)
        present = [name for name, column in batch.items() if column[index] is not None]
        return DsmtError(f"{where} has no field {text_field!r} (or it is null); fields present: "
                         f"{', '.join(present) or '(none)'}; set --text-field to the field holding the document "
                         f"text, or fix the record")
    return DsmtError(f"{where}: field {text_field!r} holds a {type(value).__name__} ({value!r:.80}), not a "
                     f"string; every document text must be a string: set --text-field to a text field, or fix "
                     f"the record")
