"""Disk space around checkpoint saves: a check before each save from the previous checkpoint's size, and a full
disk during a save turned into one named error (rule `disk_full`) instead of a library's traceback."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from toolkit.errors import DsmtError

MARGIN = 1.05  # a checkpoint at the same layout is the same size; metadata and logs take a little more


class DiskFull(DsmtError):
    """A save that does not fit, or did not (rule `disk_full`)."""


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def _size(count: int | None) -> str:
    return "unknown (no earlier checkpoint)" if count is None else f"{count / 1e6:,.1f} MB"


def _fix(directory: Path) -> str:
    return (f"fix: free space on the filesystem of {directory}, keep fewer checkpoints (training.keep_checkpoints), "
            "or point training.output_dir at a larger disk; then run the same command again to resume")


def refusal(*, directory: Path, tag: str, needed: int | None) -> str | None:
    """Why `tag` cannot be saved into `directory` (None: it fits, or there is no earlier checkpoint to size it)."""
    if needed is None:
        return None
    free = free_bytes(directory)
    if free >= needed * MARGIN:
        return None
    return (f"[disk_full] checkpoint {tag} needs about {_size(needed)} (the size of the previous checkpoint) and "
            f"{directory} has {free / 1e6:,.1f} MB free; nothing of {tag} was written\n{_fix(directory)}")


def as_disk_full(err: BaseException, *, directory: Path, tag: str, needed: int | None) -> DiskFull | None:
    """The named error when `err` came from a full disk: ENOSPC anywhere in its chain, or any failed save with
    less than 1 MiB left (torch.save says only "unexpected pos 299520 vs 299408" or "file write failed"); None for
    any other error."""
    free = free_bytes(directory) if Path(directory).exists() else 0
    if not (_enospc(err) or (isinstance(err, (OSError, RuntimeError)) and free < 1 << 20)):
        return None
    kept = "" if needed is None else " and the previous checkpoint is intact"
    said = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return DiskFull(f"[disk_full] the disk filled while saving checkpoint {tag} into {directory} "
                    f"({free / 1e6:,.1f} MB free now; the checkpoint needs about {_size(needed)}); the incomplete "
                    f"save is removed at the next start{kept} (the library said: "
                    f"{type(err).__name__}: {said})\n{_fix(directory)}")


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        # megatron's dist_checkpointing wraps each rank's failure in CheckpointException.failures
        for inner in getattr(err, "failures", {}).values() if isinstance(getattr(err, "failures", None), dict) else ():
            yield from _chain(inner)
        err = err.__cause__ or err.__context__


def _enospc(err: BaseException) -> bool:
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in str(e)
               for e in _chain(err))
