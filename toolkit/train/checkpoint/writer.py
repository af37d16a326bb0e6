"""A checkpoint's files written by a thread while training goes on, and the save finished once every rank's writer
is done (`training.async_save`).

The saving step takes each rank's share of the state into host memory (toolkit/train/checkpoint/sharded.py
`take_share`: one pageable buffer, the size of the rank's share) and returns; a thread of each rank writes its files,
hashing their bytes as it writes them (toolkit/train/checkpoint/state_file.py). The writer runs no collective, so
it cannot interleave with the training's. After each later step every rank says whether its writer is done (one
small all-reduce, only while a save is in flight); once all are, the save is finished on every rank at that same
step: the ranks' digests and index entries gathered, rank 0 writes the index, the record, the manifest and the
completion marker and renames `.partial-<tag>` into place. The next save, the end of training and a SIGTERM wait
for it. A writer that failed (a full disk) raises its named error on every rank at that point; the folder is never
renamed, so the previous checkpoint stays the newest complete one.

At most one save is in flight per process (`_IN_FLIGHT`): saves are collective, so every rank agrees on it."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.errors import DsmtError


@dataclasses.dataclass
class PendingSave:
    """One save between its snapshot and its completion."""

    partial: Path
    tag: str
    finish: Callable[[list[dict]], None]  # collective: every rank's writer outcome -> the completed checkpoint
    started: float  # perf_counter at the start of the save
    needed: int | None = None  # the previous checkpoint's bytes (None: no complete one), for a disk-full message
    blocked_s: float = 0.0  # how long the saving step held training
    shared: dict = dataclasses.field(default_factory=dict)  # what the other ranks' finish reads of this one
    outcome: dict = dataclasses.field(default_factory=dict)  # "entries" (relpath -> manifest entry) or "error"
    thread: threading.Thread | None = None


_IN_FLIGHT: PendingSave | None = None


def start(pending: PendingSave, work: Callable[[], dict], *, background: bool) -> None:
    """Run `work` (this rank's file writes: returns {relpath: manifest entry}) in a thread (`background`) or now;
    finished now unless in the background. Collective when not in the background."""
    global _IN_FLIGHT

    def run() -> None:
        try:
            pending.outcome["entries"] = work()
        except BaseException as err:  # noqa: BLE001 - the outcome carries it to the collective finish
            pending.outcome["error"] = err

    if background:
        pending.thread = threading.Thread(target=run, name=f"dsmt-save-{pending.tag}", daemon=True)
        pending.thread.start()
        pending.blocked_s = time.perf_counter() - pending.started
        _IN_FLIGHT = pending
        return
    run()
    pending.blocked_s = time.perf_counter() - pending.started
    _finish(pending)


def in_flight() -> PendingSave | None:
    return _IN_FLIGHT


def finish_if_written() -> None:
    """Collective, after a training step: finish the save in flight when every rank's writer is done."""
    if _IN_FLIGHT is None:
        return
    import torch
    import torch.distributed as dist

    from toolkit import backend as backends

    written = _IN_FLIGHT.thread is None or not _IN_FLIGHT.thread.is_alive()
    # MIN over ranks: 1 only when every writer is done (on the backend's device: NCCL takes CUDA tensors only)
    every = torch.tensor([1 if written else 0], dtype=torch.int32, device=backends.current().device)
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    if int(every.item()) == 1:
        _finish(_IN_FLIGHT)


def wait() -> None:
    """Collective: the save in flight written and finished (its error raised), or nothing to do."""
    if _IN_FLIGHT is not None:
        _finish(_IN_FLIGHT)


def _finish(pending: PendingSave) -> None:
    global _IN_FLIGHT
    import torch.distributed as dist

    _IN_FLIGHT = None  # whatever happens next, this save is no longer in flight
    if pending.thread is not None:
        pending.thread.join()
    outcomes: list = [None] * dist.get_world_size()
    error = pending.outcome.get("error")
    mine = {"entries": pending.outcome.get("entries", {}), "blocked_s": pending.blocked_s, "shared": pending.shared,
            "error": None if error is None else _describe(error, pending=pending)}
    dist.all_gather_object(outcomes, mine)
    failed = [(rank, outcome["error"]) for rank, outcome in enumerate(outcomes) if outcome["error"]]
    if failed:
        raise _failure(failed, pending=pending) from error
    pending.finish(outcomes)


def _describe(error: BaseException, *, pending: PendingSave) -> dict:
    """What the other ranks learn of this rank's failed write: whether the disk filled, and the message."""
    from toolkit.train.checkpoint import space

    full = space.as_disk_full(error, directory=pending.partial.parent, tag=pending.tag, needed=pending.needed,
                              partial=pending.partial)
    if full is not None:
        return {"disk_full": True, "message": str(full)}
    return {"disk_full": False, "message": f"{type(error).__name__}: {error}"}


def _failure(failed: list, *, pending: PendingSave) -> DsmtError:
    from toolkit.train.checkpoint import space
    from toolkit.train.checkpoint.folders import CheckpointIOError

    full = [error for _, error in failed if error["disk_full"]]
    if full:
        return space.DiskFull(full[0]["message"])
    rank, error = failed[0]
    return CheckpointIOError(f"[checkpoint_io] rank {rank} could not write its part of checkpoint {pending.tag} "
                             f"({error['message']}); {len(failed)} rank(s) failed; the checkpoint was not completed "
                             f"and the previous one is intact\nfix: check the filesystem of {pending.partial.parent} "
                             "(mounted, writable, not full); then run the same command again to resume")
