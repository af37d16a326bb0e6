"""Disk space around checkpoint saves: a check before each save from the previous checkpoint's size, and a full
disk during a save turned into one named error (rule `disk_full`) instead of a library's traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

from toolkit.errors import DsmtError, disk_full_cause, failure_chain
from toolkit.train.checkpoint.folders import PARTIAL

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


def copy_refusal(*, directory: Path, needed: int) -> str | None:
    """Why the state of the save in `directory` (a `.partial-<tag>` folder) does not fit (None: it does). Checked
    at every save, the first too: the ranks' shares are sized before a byte is written."""
    free = free_bytes(directory)
    if free >= needed * MARGIN:
        return None
    tag = Path(directory).name.removeprefix(PARTIAL)
    return (f"[disk_full] the state of checkpoint {tag} needs about {_size(needed)} and "
            f"{Path(directory).parent} has {free / 1e6:,.1f} MB free; nothing of it was written, the folder is "
            f"removed at the next start and earlier checkpoints are intact\n{_fix(Path(directory).parent)}")


def as_disk_full(err: BaseException, *, directory: Path, tag: str, needed: int | None,
                 partial: Path | None = None) -> DiskFull | None:
    """The named error when `err` came from a full disk: ENOSPC anywhere in its chain or in any rank's failure
    that torch.distributed.checkpoint gathered (its CheckpointException), or any failed write with less than 1 MiB
    left (torch.save says only "unexpected pos 299520 vs 299408" or "file write failed"); None for any other error.
    The library's words quoted are those of the failure itself, never of the wrapper that names the rank which
    hit the full disk first: the disk is full for every rank. `partial`: the save's folder, whose bytes so far say
    what the checkpoint needs at least when no earlier checkpoint sizes it."""
    free = free_bytes(directory) if Path(directory).exists() else 0
    full = disk_full_cause(err)
    if full is None and free < 1 << 20:
        full = next((e for e in failure_chain(err) if isinstance(e, (OSError, RuntimeError))), None)
    if full is None:
        return None
    kept = "" if needed is None else " and the previous checkpoint is intact"
    if needed is None and partial is not None and Path(partial).is_dir():
        written = sum(path.stat().st_size for path in Path(partial).rglob("*") if path.is_file())
        need = f"more than the {written / 1e6:,.1f} MB it had written"
    else:
        need = f"about {_size(needed)}"
    said = str(full).strip().splitlines()[0][:200] if str(full).strip() else ""
    return DiskFull(f"[disk_full] the disk filled while saving checkpoint {tag} into {directory} "
                    f"({free / 1e6:,.1f} MB free now; the checkpoint needs {need}); the incomplete save is removed "
                    f"at the next start{kept} (the library said: {type(full).__name__}: {said})\n{_fix(directory)}")
