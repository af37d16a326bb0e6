"""The folders of a checkpoint directory, as rank 0 changes them: a finished save renamed into place, what an
interrupted save left removed, a damaged checkpoint set aside; the one order of its tags (`tag_order`); and
`checkpoint_io_error`, what a filesystem error of such a change becomes on every rank (rank 0 makes the change
through `toolkit.launch.rank0.on_rank0`: an error on a shared filesystem must not leave the other ranks waiting in
a collective until the timeout)."""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

from toolkit.errors import DsmtError

COMPLETE_MARKER = "dsmt_complete.json"
PARTIAL = ".partial-"  # a save in progress, renamed to its tag when complete
DAMAGED = ".damaged-"  # a checkpoint whose files did not match its manifest, set aside by a resume
PRUNING = ".pruning-"  # an old checkpoint being deleted (keep_checkpoints) by a thread of rank 0
_REMOVING: dict[Path, threading.Thread] = {}  # what this process's threads are deleting now
TAG = re.compile(r"step_(\d+)")  # a checkpoint tag: step_000010 as dsmt saves it, step_10 as a person may name one


class CheckpointIOError(DsmtError):
    """The filesystem refused a change to the checkpoint directory (rule `checkpoint_io`)."""


def checkpoint_io_error(err: OSError, *, what: str) -> CheckpointIOError:
    """What an OSError of rank 0's change `what` to a checkpoint directory becomes on every rank (`on_rank0`'s
    `os_error`)."""
    return CheckpointIOError(f"[checkpoint_io] {what}: {type(err).__name__}: {err}\nfix: check the filesystem of "
                             "the output directory (mounted, writable, not full); then run the same command again to "
                             "resume")


def tag_step(name: str) -> int | None:
    """The step of checkpoint tag `name` (step_000010 and step_10: 10); None for any other name."""
    match = TAG.fullmatch(name)
    return int(match.group(1)) if match else None


def tag_order(name: str) -> tuple[bool, int, str]:
    """The sort key of every ordering of checkpoint tags, oldest first: by step number, never by name
    (step_000010 after step_000009, step_10 after step_9); equal steps by name, other names last."""
    step = tag_step(name)
    return step is None, step or 0, name


def publish(partial: Path, final: Path) -> None:
    """Rename the finished save to its tag. A tag saved again (a script may) is renamed aside first and removed
    only after the new one is in place: a crash in between leaves the new one complete under either name."""
    aside = final.with_name(f"{PARTIAL}replaced-{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.rename(partial, final)
    shutil.rmtree(aside, ignore_errors=True)


def write_small(path: Path, text: str) -> None:
    """A marker or pointer file. No fsync, as for the checkpoint's own files (DeepSpeed does not sync them, and
    on ext4 syncing a small file flushes every dirty byte of the filesystem, a whole checkpoint's): after a power
    loss a torn checkpoint fails its manifest and a resume falls back to an older one."""
    path.write_text(text)


def remove_in_background(path: Path) -> None:
    """Delete `path` (renamed out of the way already) in a thread: deleting an old checkpoint of a large model
    (1-2 TB of files) takes minutes, which no rank should spend while the others wait in a collective. A run
    ended in the middle leaves it for `remove_leftovers`."""
    def remove() -> None:
        shutil.rmtree(path, ignore_errors=True)
        _REMOVING.pop(path, None)

    _REMOVING[path] = threading.Thread(target=remove, name=f"dsmt-remove-{path.name}", daemon=True)
    _REMOVING[path].start()


def wait_for_removals() -> None:
    """Every deletion `remove_in_background` started, finished."""
    for thread in list(_REMOVING.values()):
        thread.join()


def remove_leftovers(checkpoint_dir: Path) -> list[str]:
    """Remove what interrupted saves left (`.partial-*` folders, and `step_*` folders without a completion marker
    from before saves were renamed into place); one line per folder. Only the run that holds the directory's lock
    calls this (toolkit/launch/run_lock.py), so nothing here is a save in progress. A folder that will not go (files
    held open on NFS) is renamed aside, so that the next save of its step starts from an empty folder."""
    lines = []
    for path in sorted(Path(checkpoint_dir).glob(f"{PRUNING}*")):  # a deletion a stopped run left unfinished
        if path not in _REMOVING:
            shutil.rmtree(path, ignore_errors=True)
    tags = sorted(Path(checkpoint_dir).glob("step_*"), key=lambda path: tag_order(path.name))
    for path in sorted(Path(checkpoint_dir).glob(f"{PARTIAL}*")) + tags:
        if not path.is_dir() or (path.name.startswith("step_") and (path / COMPLETE_MARKER).exists()):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if path.exists() and path.name.startswith("step_"):
            stuck = path.with_name(f"{PARTIAL}stuck-{path.name}")
            os.replace(path, stuck)
            lines.append(f"moved {path} aside to {stuck.name}: an interrupted save that could not be removed")
        elif path.exists():
            lines.append(f"could not remove {path} (an interrupted save); remove it by hand")
        else:
            lines.append(f"removed {path}: an interrupted save (no completion marker)")
    return lines


def set_aside_damaged(checkpoint_dir: Path, tag: str) -> Path:
    """Rename a damaged tag to `.damaged-<tag>` (kept for a person to inspect; no resume or prune counts it)."""
    aside = Path(checkpoint_dir) / f"{DAMAGED}{tag}"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(Path(checkpoint_dir) / tag, aside)
    return aside
