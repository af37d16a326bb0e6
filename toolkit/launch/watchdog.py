"""A job dies together: a rank whose launcher is gone stops, with every helper process it started.

torchrun, the deepspeed launcher, mpirun's daemon and srun's step daemon each start the ranks as their children.
When that parent is killed (SIGKILL, an OOM kill, a node agent restart) the ranks are re-parented and would train
on to the end with no one to report to, writing checkpoints into a directory the next run uses. A thread in each
rank watches its parent: once the parent is gone the rank kills its own descendants (multiprocessing's resource
tracker, dist_checkpointing's writers) and itself. `dsmt train` also asks the kernel to SIGTERM torchrun when
`dsmt train` dies (`parent_death_signal`), and torchrun stops its workers on SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# What each launcher exports to the processes it starts: torchrun, dsmt's own (and a plugged rank runner's), the
# deepspeed launcher's launch.py, mpirun, srun, MPICH / Intel MPI. A process started by hand from a shell is not
# watched: a `nohup python -m toolkit.train ... &` must outlive its shell.
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "DSMT_LOG_DIR", "CROSS_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_STEP_ID",
                "PMI_RANK")


def started_by_launcher(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return any(name in environ for name in LAUNCHER_ENV)


def die_with_parent(*, what: str) -> None:
    """Start the watch on this process's current parent (`what`: how the rank names itself in its last line), when
    that parent is a launcher (`LAUNCHER_ENV`)."""
    parent = os.getppid()
    if parent == 1 or not started_by_launcher():  # init (a container's entry point), or a shell: not watched
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        print(f"dsmt: {what}: its launcher (pid {parent}) is gone; stopping this rank and its helper processes",
              file=sys.stderr, flush=True)
        kill_descendants()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dsmt-watchdog", daemon=True).start()


def kill_descendants() -> None:
    """SIGKILL every process this one started, children of children included."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def parent_death_signal(sig: int = signal.SIGTERM):
    """A `preexec_fn` for subprocess: the child gets `sig` when the process that started it dies (Linux; no-op
    elsewhere). The parent may already be gone by the time the child runs this: then it signals itself now."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    try:  # loaded here, in the parent: a forked child should call, not load
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm
