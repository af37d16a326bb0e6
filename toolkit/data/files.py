"""How a data file's name and lines are read, shared by the source stage (toolkit/data/sources.py), the record
checks (toolkit/data/formats.py) and `dsmt data prepare` (toolkit/data/prepare_inputs.py); and a file's digest,
shared by Megatron corpora's sidecars (toolkit/data/corpus_check.py) and checkpoint manifests
(toolkit/train/checkpoint/manifest.py)."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import xxhash

from toolkit.spec.data_paths import COMPRESSION_SUFFIXES, file_suffix  # noqa: F401  (the readers' names for them)

LINE_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # .zst: no reader here, so no line numbers
# Files `save_to_disk` writes at a dataset's (or a DatasetDict's) top level.
SAVE_TO_DISK_MARKERS = ("state.json", "dataset_dict.json")
CHUNK_BYTES = 8 * 2**20  # large enough that the per-call overhead vanishes, small enough to keep memory flat


def digest_file(path: Path) -> str:
    """The xxh3_128 hex digest of a file, read in 8 MiB chunks (a checkpoint or a corpus may exceed memory) into
    one reused buffer: a fresh 8 MiB bytes per chunk page-faults its memory in each time, which made hashing a
    torch.save file from the page cache ~5x slower (benchmarks/manifest_cost.py). xxh3_128 rather than a
    cryptographic hash: the threat is a damaged disk or an interrupted copy, not an adversary, and it hashes at
    memory speed (~0.3 s per GB from the page cache on a shared 2-core machine)."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as reader:
        while count := reader.readinto(buffer):
            hasher.update(view[:count])
    return hasher.hexdigest()


def is_save_to_disk_dir(path: Path) -> bool:
    return any((path / marker).is_file() for marker in SAVE_TO_DISK_MARKERS)


def _open_lines(path: Path):
    """`path` opened for reading its lines as bytes, through one gz/bz2/xz wrapper; None for one not readable here."""
    suffix = path.suffix.lower()
    if suffix in COMPRESSION_SUFFIXES and suffix not in LINE_OPENERS:
        return None
    return LINE_OPENERS.get(suffix, open)(path, "rb")


def _holds_json_lines(path: Path) -> bool:
    """A `.jsonl` file, or a `.json` one whose first non-blank line is a whole JSON object (not one list);
    either may be compressed."""
    suffix = file_suffix(path)
    if suffix not in (".jsonl", ".json") or not path.is_file():
        return False
    if suffix == ".jsonl":
        return True
    lines = _open_lines(path)
    if lines is None:
        return False
    with lines:
        first = next((line for line in lines if line.strip()), b"")
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def line_numbers(*, path: str | Path, indices) -> dict[int, int]:
    """Record index (from 0) -> 1-based line of a JSON-lines file (compressed too), for `indices`; {} for any other
    source. The json loader skips blank lines, so record i is the i-th non-blank line."""
    path, wanted, found = Path(path), set(indices), {}
    if not wanted or not _holds_json_lines(path):
        return found
    lines = _open_lines(path)
    if lines is None:
        return found
    with lines:
        index = 0
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if index in wanted:
                found[index] = number
                if len(found) == len(wanted):
                    break
            index += 1
    return found


JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}
SHOWN_CHARS = 60  # of a bad line, in a one-line report
LINES_FIX = "; fix that line (a JSON-lines file holds one whole JSON object per line)"


def bad_json_line(path: Path) -> str | None:
    """Where a JSON file stops being what `datasets`' json builder reads, as a sentence naming the 1-based line
    and the fix: the first line of a JSON-lines file that is not one JSON object, or where a whole-JSON file
    stops parsing; None when all of it parses (the fault is elsewhere) or it cannot be read here (.zst). Called
    once the builder failed: pyarrow's own message counts rows from 0 and skips blank lines."""
    suffix = file_suffix(path)
    lines = _open_lines(path) if suffix in (".jsonl", ".json") else None
    if lines is None:
        return None
    with lines:
        if suffix == ".json" and not _holds_json_lines(path):
            return _bad_json_document(lines.read().decode("utf-8", errors="replace"))
        for number, raw in enumerate(lines, start=1):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except ValueError as err:
                return f"line {number} is not valid JSON ({err.msg} at column {err.colno}): {_shown(text)}{LINES_FIX}"
            if not isinstance(value, dict):
                return f"line {number} is {JSON_KINDS[type(value)]}, not a JSON object: {_shown(text)}{LINES_FIX}"
    return None


def _bad_json_document(text: str) -> str | None:
    try:
        json.loads(text)
    except ValueError as err:
        lines = text.splitlines()
        line = lines[err.lineno - 1] if err.lineno <= len(lines) else ""
        return (f"line {err.lineno} is not valid JSON ({err.msg} at column {err.colno}): {_shown(line)}; fix the "
                "JSON there (a .json file holds one array of objects, or one object per line)")
    return None


def _shown(line: str) -> str:
    return repr(line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + "...")
