"""`dsmt data prepare`'s files beside the corpus: the temporaries a killed run left (`PREFIX.tmp-<pid>.*`, removed
by the next run into the same prefix), and a full disk turned into one named error (rule `disk_full`, the shape of
toolkit/train/checkpoint/space.py's) instead of a library's traceback."""

from __future__ import annotations

import glob
import os
import re
import shutil
from pathlib import Path

from toolkit.errors import DsmtError, disk_full_cause
from toolkit.launch.identity import pid_running

TEMP_SUFFIXES = (".bin", ".idx", ".dsmt.json")
HEADER_BYTES, BYTES_PER_DOCUMENT = 34, 20  # .idx: header, then int32 length + int64 pointer + int64 document index


def temporary_prefix(prefix: str) -> str:
    """Where this process writes `prefix`'s files before renaming them into place."""
    return f"{prefix}.tmp-{os.getpid()}"


def remove_stale_temporaries(prefix: str) -> str | None:
    """Remove the `prefix`.tmp-<pid>.* files of runs no longer running on this machine (a kill -9, a lost node:
    no `finally` ran); the one line saying what was removed, and what was kept because its pid runs, or None."""
    base = Path(prefix)
    pattern = re.compile(re.escape(base.name) + r"\.tmp-(\d+)(" + "|".join(map(re.escape, TEMP_SUFFIXES)) + ")")
    stale: dict[int, list[Path]] = {}
    kept: dict[int, list[Path]] = {}
    for path in sorted(base.parent.glob(glob.escape(base.name) + ".tmp-*")):
        match = pattern.fullmatch(path.name)
        if match is not None and path.is_file():
            pid = int(match.group(1))
            (kept if pid_running(pid) else stale).setdefault(pid, []).append(path)
    removed_bytes = 0
    for paths in stale.values():
        for path in paths:
            removed_bytes += path.stat().st_size
            path.unlink(missing_ok=True)
    said = []
    if stale:
        names = ", ".join(path.name for paths in stale.values() for path in paths)
        said.append(f"removed {names} ({removed_bytes / 1e6:,.1f} MB), left by an interrupted run into {prefix} "
                    f"(pid {', '.join(map(str, stale))}, no longer running)")
    if kept:
        names = ", ".join(path.name for paths in kept.values() for path in paths)
        said.append(f"kept {names}: pid {', '.join(map(str, kept))} is running (another dsmt data prepare into "
                    "the same --output?)")
    return f"dsmt data prepare: {'; '.join(said)}" if said else None


def temporary_bytes(temp: str) -> int:
    return sum(Path(temp + suffix).stat().st_size for suffix in TEMP_SUFFIXES if Path(temp + suffix).is_file())


def input_bytes(paths) -> int:
    """The inputs' size on disk: files, and every file under an input directory."""
    total = 0
    for path in map(Path, paths):
        files = [path] if path.is_file() else [item for item in path.rglob("*") if item.is_file()]
        total += sum(item.stat().st_size for item in files)
    return total


def disk_full_error(err: BaseException, *, prefix: str, written_bytes: int, counts, itemsize: int,
                    inputs: list[Path]) -> DsmtError | None:
    """The named error when `err` came from a full disk (ENOSPC / EDQUOT anywhere in its chain), else None.
    `counts`: the documents tokenised so far, their tokens and the characters of text they came from; the bytes
    the whole corpus needs are estimated from them and the size of `inputs` (an estimate: JSON syntax counts as
    text, compressed inputs as less)."""
    if disk_full_cause(err) is None:
        return None
    inputs_bytes = input_bytes(inputs)
    directory = Path(prefix).parent
    free = shutil.disk_usage(directory).free
    so_far = counts.num_tokens * itemsize + HEADER_BYTES + BYTES_PER_DOCUMENT * counts.num_documents
    if counts.num_text_chars:
        scale = max(inputs_bytes / counts.num_text_chars, 1.0)
        needed = (f"about {so_far * scale / 1e6:,.1f} MB ({counts.num_tokens / counts.num_text_chars:.2f} tokens "
                  f"of {itemsize} bytes per character so far, over the inputs' {inputs_bytes / 1e6:,.1f} MB)")
    else:
        needed = f"more than the {written_bytes / 1e6:,.1f} MB written"
    said = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return DsmtError(f"[disk_full] the disk filled while dsmt data prepare wrote {prefix}.bin/.idx "
                     f"({written_bytes / 1e6:,.1f} MB written of {counts.num_documents:,} documents tokenised): the "
                     f"corpus needs {needed} and {directory} has {free / 1e6:,.1f} MB free; the partial files are removed and "
                     f"{prefix}.* is as it was (the library said: {type(err).__name__}: {said})\n"
                     f"fix: free space on the filesystem of {directory}, or give --output a prefix on a larger disk; "
                     "then run the same command again")
