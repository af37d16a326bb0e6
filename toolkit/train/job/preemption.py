"""Preemption: SIGTERM ends a training run at a step boundary, with a checkpoint of that step, and exit code 75.

SLURM sends SIGTERM at preemption and before the time limit, then SIGKILL after its grace period; `dsmt train`'s
launcher passes its own SIGTERM on, and torchrun passes its own to its workers. Without a handler every rank died at
once and up to `checkpoint_interval` steps were lost. Here SIGTERM only raises a flag, and the ranks act on it
together: the signal may reach them at different moments, or only some of them (srun signals each task itself), so
after every step all ranks all-reduce (MAX) their 0/1 flag and every rank gets the same answer at the same step.
Every rank calls it at the same point of the loop, so none waits in it for a rank that is elsewhere; it is one
4-byte collective per step.

SIGTERM also comes from torchrun stopping the survivors of a rank that failed; they must die at once, as before (a
survivor blocked in an NCCL collective would not reach the next step boundary). So the flag is raised by a thread,
woken through `signal.set_wakeup_fd` even while the main thread is blocked in C++, which first checks the other ranks'
heartbeats (toolkit/launch/heartbeat.py) and exits the rank at once when one of them failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure; the same command again resumes the run
_requested = threading.Event()
_training = threading.Event()  # set once the training loop runs (training_started)


class Preempted(SystemExit):
    """Raised on every rank once the agreed step's checkpoint is saved: the rank exits with EXIT_CODE (run_rank and
    the launchers pass SystemExit on, so nothing reports it as a failure)."""

    def __init__(self, *, step: int):
        super().__init__(EXIT_CODE)
        self.step = step


def requested() -> bool:
    return _requested.is_set()


@contextlib.contextmanager
def stop_on_sigterm():
    """While inside, SIGTERM asks this rank to stop at the next step boundary (`agreed_stop`) instead of killing it.
    Main thread only (a signal handler can be set nowhere else)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the listening thread acts
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_listen, args=(read_fd,), name="dsmt-sigterm", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous_handler)
        os.close(write_fd)  # the thread reads end-of-file and returns


def _listen(read_fd: int) -> None:
    """Each byte is the number of a signal this process received (Python's C handler writes it at once)."""
    with os.fdopen(read_fd, "rb", buffering=0) as wakeups:
        while received := wakeups.read(64):
            if signal.SIGTERM in received:
                on_sigterm()


def training_started() -> None:
    """From here on SIGTERM stops the rank at a step boundary; before (process groups, model build, resume) it ends
    the rank at once: a peer that failed early leaves the others blocked where no step boundary comes."""
    _training.set()


def on_sigterm() -> None:
    """A preemption raises the flag; SIGTERM before training started, or after another rank failed on this machine,
    ends this rank now. (A failure on another node is seen at the next step's collective, which then fails.)"""
    from toolkit.launch import heartbeat, watchdog
    from toolkit.launch.rank_output import LOG_DIR_ENV, this_rank

    if not _training.is_set():
        watchdog.kill_descendants()
        os._exit(128 + signal.SIGTERM)
    failed = heartbeat.my_suspects(this_machine_only=True)
    if failed:  # torchrun (or a plugged rank runner) stopping the survivors of a failure: stop now, as ever
        if this_rank() != 0 or not os.environ.get(LOG_DIR_ENV):  # else dsmt's launcher names the failed rank
            rank, why = failed[0]
            print(f"dsmt train: SIGTERM after rank {rank} failed ({why}): stopping this rank now", file=sys.stderr,
                  flush=True)
        watchdog.kill_descendants()
        os._exit(128 + signal.SIGTERM)
    _requested.set()


def agreed_stop() -> bool:
    """Collective, on every rank after every step: whether any rank was asked to stop (the same answer on all)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:  # nobody to agree with
        return _requested.is_set()
    from toolkit import backend as backends

    flag = torch.tensor([1 if _requested.is_set() else 0], dtype=torch.int32, device=backends.current().device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def announce(*, step: int) -> None:
    """Rank 0's one line, once the ranks agreed to stop after `step`."""
    print(f"dsmt train: SIGTERM received (preemption or time limit): finishing step {step}, saving, then exiting "
          f"with code {EXIT_CODE}", flush=True)
