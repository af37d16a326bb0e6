"""Runs a plan of `dsmt train` jobs on every rank (one process group, as test_train_reshard.py does) with the
checkpoint's two entry points measured: around each `checkpoints.save` and `checkpoints.resume` the kernel's
high-water mark (VmHWM) is reset (`/proc/self/clear_refs` 5) and read after, against the resident memory (VmRSS)
at the start. Each rank's background writer is slowed by DSMT_PROBE_WRITE_DELAY_S seconds before it writes, and the time its
writing ended is kept, so a test can see whether the saving step returned before the write ended. One JSON line
per call to $DSMT_SAVE_PROBE/rankN.jsonl."""

import json
import os
import sys
import threading
import time
from pathlib import Path

from toolkit.convert.progress import proc_status_bytes
from toolkit.train.checkpoint import checkpoints

PROBE = Path(os.environ.get("DSMT_SAVE_PROBE", "."))
_save, _resume, _write = checkpoints.save, checkpoints.resume, checkpoints._write_rank_files
WRITES: list[float] = []  # when each write of this rank ended (time.time)


def _measured(function, kind: str):
    def call(**kwargs):
        import torch.distributed as dist

        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        baseline = proc_status_bytes("VmRSS")
        result = function(**kwargs)
        record = {"kind": kind, "peak_above_baseline": proc_status_bytes("VmHWM") - baseline,
                  "kept_after": proc_status_bytes("VmRSS") - baseline,
                  "returned": time.time(), "step": kwargs.get("step"), "background": kwargs.get("background")}
        with (PROBE / f"rank{dist.get_rank()}.jsonl").open("a") as out:
            out.write(json.dumps(record) + "\n")
        return result
    return call


def slow_write(partial, **kwargs):
    import torch.distributed as dist

    if threading.current_thread() is not threading.main_thread():  # a background save's writer
        time.sleep(float(os.environ.get("DSMT_PROBE_WRITE_DELAY_S", "0")))
    entries = _write(partial, **kwargs)
    with (PROBE / f"rank{dist.get_rank()}.jsonl").open("a") as out:
        out.write(json.dumps({"kind": "written", "tag": partial.name, "ended": time.time()}) + "\n")
    return entries


def main(plan_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.spec.load import load_spec
    from toolkit.train.job.run import train

    checkpoints.save = _measured(_save, "save")
    checkpoints.resume = _measured(_resume, "resume")
    checkpoints._write_rank_files = slow_write
    dist.init_process_group("gloo")
    for action, *args in json.loads(Path(plan_path).read_text()):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if action == "cut":
            if dist.get_rank() == 0:
                from train_helpers import cut_back

                cut_back(Path(args[0]), Path(args[1]), to_step=args[2])
            dist.barrier()
        else:
            train(job=job_of(spec=load_spec(args[0]), report=Report(source=args[0], problems=())))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
