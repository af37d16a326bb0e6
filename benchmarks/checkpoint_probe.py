"""A rank of `python -m toolkit.train` with the checkpoint entry points measured (benchmarks/checkpoint_cost.py
starts it): `toolkit.train.checkpoint.checkpoints.save` and `.resume` are wrapped, and each call records this
rank's peak host memory above its resident memory at the call's start (the kernel's high-water mark VmHWM, reset
just before through /proc/self/clear_refs), the bytes read and written (/proc/self/io deltas: rchar / wchar count
every read() / write(), read_bytes / write_bytes what reached the block device) and the seconds the call held the
training loop. The wrappers take *args / **kwargs, so they fit whatever signature those functions have.

A save that returns before its write is done (`background=True`, where the checkpoint code has it) is then waited
for at once (`wait_for_save`), so the high-water mark covers the writer thread and not a training step: `blocked_s`
is the save call alone, `completed_s` the call and the wait. Each rank writes $DSMT_CHECKPOINT_PROBE/rankN.json,
{"events": [...]}, appending to what an earlier launch of the same run wrote."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

from toolkit.convert.progress import proc_status_bytes
from toolkit.train.checkpoint import checkpoints

PROBE_ENV = "DSMT_CHECKPOINT_PROBE"
IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")


def io_counters() -> dict[str, int]:
    """This process's /proc/self/io counters (all its threads, the writer threads included)."""
    counters = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        name, _, value = line.partition(":")
        counters[name.strip()] = int(value)
    return {name: counters[name] for name in IO_FIELDS}


class Measurement:
    """The memory, I/O and time of one stretch of this rank's work, from `__init__` to `finish`."""

    def __init__(self) -> None:
        import torch.distributed as dist

        dist.barrier()  # every rank starts together: the seconds are the call's, not a wait for a slower rank
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        self.baseline_rss = proc_status_bytes("VmRSS")
        self.io = io_counters()
        self.started = time.perf_counter()

    def finish(self) -> dict:
        seconds = time.perf_counter() - self.started
        io = io_counters()
        return {"seconds": seconds, "baseline_rss": self.baseline_rss,
                "peak_above_baseline": proc_status_bytes("VmHWM") - self.baseline_rss,
                # what stays resident after the call: a resume's Adam moments (held by every run after its
                # first step), a background save's host copy until its writer is done
                "kept_after": proc_status_bytes("VmRSS") - self.baseline_rss,
                **{name: io[name] - self.io[name] for name in IO_FIELDS}}


def record(event: dict) -> None:
    import torch.distributed as dist

    path = Path(os.environ[PROBE_ENV], f"rank{dist.get_rank()}.json")
    events = json.loads(path.read_text())["events"] if path.exists() else []
    path.write_text(json.dumps({"events": [*events, event]}, indent=1))


def measured_save(save):
    @functools.wraps(save)
    def wrapper(*args, **kwargs):
        measurement = Measurement()
        result = save(*args, **kwargs)
        blocked_s = time.perf_counter() - measurement.started
        if kwargs.get("background") and hasattr(checkpoints, "wait_for_save"):
            checkpoints.wait_for_save()
        figures = measurement.finish()
        record({"kind": "save", "step": kwargs.get("step"), "blocked_s": blocked_s,
                "completed_s": figures.pop("seconds"), "background": bool(kwargs.get("background")), **figures})
        return result
    return wrapper


def measured_resume(resume):
    @functools.wraps(resume)
    def wrapper(*args, **kwargs):
        measurement = Measurement()
        resumed = resume(*args, **kwargs)
        figures = measurement.finish()
        record({"kind": "resume", "step": getattr(resumed, "step", None), "blocked_s": figures.pop("seconds"),
                **figures})
        return resumed
    return wrapper


def main() -> int:
    from toolkit.launch.rank_output import run_rank
    from toolkit.train.__main__ import main as train_main

    if not os.environ.get(PROBE_ENV):
        raise SystemExit(f"{PROBE_ENV} must name the folder for the per-rank JSON (benchmarks/checkpoint_cost.py "
                         "sets it)")
    # The trainer calls checkpoints.save / checkpoints.resume through the module, so patching it reaches them.
    checkpoints.save = measured_save(checkpoints.save)
    checkpoints.resume = measured_resume(checkpoints.resume)
    return run_rank(train_main, command="dsmt train")


if __name__ == "__main__":
    sys.exit(main())
