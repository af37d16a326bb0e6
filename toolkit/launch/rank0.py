"""Work that rank 0 does for every rank: `on_rank0`, the one helper. Every rank calls it; rank 0 runs the task and
every rank returns its result, or raises its error, so that no rank is left waiting on a failure it never sees.

Two ways for the other ranks to wait, by how long the task may take:
  * a short task (a directory listing, a rename, a size): they wait in a broadcast of the outcome, under the
    process group's collective timeout;
  * a long task (the HF export, tokenising a corpus into the data cache), `status_file` given: they poll that file,
    which rank 0 rewrites with a heartbeat while it works. A collective would time out after the group's timeout
    (600 s) however well the work goes; the heartbeat lets them wait as long as rank 0 is alive, and carries its
    failure to them. The file's directory must be shared by all ranks, as the checkpoints already require.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from toolkit.errors import DsmtError

HEARTBEAT_S = 5.0
STALE_AFTER_S = 120.0  # no heartbeat for this long: the working rank died (or its filesystem is gone)


class RankTaskError(DsmtError):
    """The rank doing a task for all ranks failed, or stopped signalling that it is alive."""


def on_rank0(task, *, what: str, status_file: Path | None = None, stale_after_s: float = STALE_AFTER_S,
             os_error=None):
    """Collective: rank 0 runs `task`; every rank returns its result or raises the same error. `what` names the
    work in errors.

    Without `status_file`: `task()`; its (picklable) result, or the DsmtError it raised, is broadcast to every
    rank. `os_error(err, what=what)`: the DsmtError every rank raises for an OSError of the task (without it, an
    OSError is rank 0's alone).
    With `status_file`: `task(progress)` (`progress(message)` is shown in the file); its JSON-able result is read
    from the file by the other ranks; its failure raises as it was on rank 0 and as RankTaskError on the others,
    as does a heartbeat silent for `stale_after_s`."""
    import torch.distributed as dist

    if status_file is None:
        return _broadcast_outcome(task, what=what, os_error=os_error)
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # names this run's status, so a stale file is never taken as done
    if dist.get_rank() == 0:
        return lead_task(task, status_file=status_file, token=token[0])
    return wait_for_task(status_file=status_file, token=token[0], what=what, stale_after_s=stale_after_s)


def _broadcast_outcome(task, *, what: str, os_error):
    import torch.distributed as dist

    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome = [(True, task())]
        except DsmtError as err:
            outcome = [(False, err)]
        except OSError as err:
            if os_error is None:
                raise
            outcome = [(False, os_error(err, what=what))]
    dist.broadcast_object_list(outcome, src=0)
    done, value = outcome[0]
    if not done:
        raise value
    return value


def _write_status(path: Path, status: dict) -> None:
    temp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    temp.write_text(json.dumps(status))
    os.replace(temp, path)  # readers see the old or the new status, never half of one


def _read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def lead_task(task, *, status_file: Path, token: str, heartbeat_s: float = HEARTBEAT_S):
    """Run `task(progress)` and publish its state in `status_file`: "running" with a heartbeat counter every
    `heartbeat_s` (and the last `progress(message)`), then "done" with the task's (JSON-able) result, or "failed"
    with the error (re-raised here)."""
    import threading

    status_file = Path(status_file)
    status_file.parent.mkdir(parents=True, exist_ok=True)
    lock, stop = threading.Lock(), threading.Event()
    state = {"token": token, "state": "running", "beat": 0, "progress": "started", "error": None, "result": None}

    def publish(**changes):
        with lock:
            state.update(changes)
            state["beat"] += 1
            _write_status(status_file, state)

    def beat():
        while not stop.wait(heartbeat_s):
            publish()

    publish()
    thread = threading.Thread(target=beat, name="dsmt-status-heartbeat", daemon=True)
    thread.start()
    try:
        result = task(lambda message: publish(progress=message))
    except BaseException as err:
        stop.set()
        thread.join()
        publish(state="failed", error=f"{type(err).__name__}: {err}")
        raise
    stop.set()
    thread.join()
    publish(state="done", result=result)
    return result


def wait_for_task(*, status_file: Path, token: str, what: str, stale_after_s: float = STALE_AFTER_S,
                  poll_s: float = 0.5):
    """The task's result once the task with `token` is done; RankTaskError when it failed or its heartbeat stopped for
    `stale_after_s` (measured on this rank's clock from the last change seen, so clocks need not agree)."""
    import time

    last_beat, last_change = None, time.monotonic()
    while True:
        status = _read_status(Path(status_file))
        if status is not None and status.get("token") == token:  # another run's leftover file is not ours
            if status["state"] == "done":
                return status.get("result")
            if status["state"] == "failed":
                raise RankTaskError(f"{what} failed on rank 0: {status['error']}")
            if status["beat"] != last_beat:
                last_beat, last_change = status["beat"], time.monotonic()
        if time.monotonic() - last_change > stale_after_s:
            ours = status is not None and status.get("token") == token
            seen = f"last progress: {status['progress']}" if ours else "it never started"
            raise RankTaskError(f"{what}: rank 0 has not updated {status_file} for {stale_after_s:.0f} s ({seen}); "
                                "it died or hangs: see rank 0's output")
        time.sleep(poll_s)
