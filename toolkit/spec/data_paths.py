"""What a `data.path` names, as the spec and the data stages both read it: a file whose extension (looked through
one compression suffix) says its `datasets` builder, or a hub dataset id. Here, below both, so that the spec's
path pinning (toolkit/spec/paths.py) leaves a dataset name unpinned without importing the data stages."""

from __future__ import annotations

import re
from pathlib import Path

COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
# Extension -> `datasets` packaged builder. `.json` is handled by the json builder whether it holds JSON lines or
# one top-level list of records.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                 ".arrow": "arrow"}
# `data.format` -> builder, for files whose extension says nothing useful.
FORMAT_BUILDERS = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "text": "text",
                   "arrow": "arrow"}
# A hub dataset id: `name` or `owner/name`, letters, digits, '-', '_', '.'; no extension we know as a file.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def file_suffix(path: Path) -> str:
    """The extension that says the format, looking through one compression suffix (`a.jsonl.gz` -> `.jsonl`)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def looks_like_hub_id(text: str) -> bool:
    # A path with a known file extension, or one that starts like a filesystem path, is a missing local file.
    if text.startswith((".", "/", "~")) or file_suffix(Path(text)) in FILE_BUILDERS:
        return False
    return bool(HUB_ID_RE.match(text))
