"""The forked side of tests/harness/warm_ranks.py: turn a copy of a warm server into the rank a fresh
`python -m module` / `python script.py` under torchrun would have been, run it, and exit as it would."""

from __future__ import annotations

import atexit
import logging
import os
import random
import runpy
import signal
import sys
import threading
import traceback
import warnings


def become_rank(request: dict, *, stdout_fd: int, stderr_fd: int) -> None:
    """Never returns: the process exits with the rank's exit code."""
    os.setpgrp()  # the manager stops the rank and whatever it started as one group
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stdin = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((stdin, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # atexit keeps what the server's imports registered (multiprocessing's, which stops daemonic children): a new
    # process would have registered the same; the server registers nothing of its own
    fresh_interpreter_state(target=request["target"], args=request["args"], cwd=request["cwd"])
    code = run(request["target"])
    threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads, then atexit
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def fresh_interpreter_state(*, target: list[str], args: list[str], cwd: str) -> None:
    """What a new interpreter would have: argv, sys.path[0] and PYTHONPATH, warning filters, thread count, and
    RNG streams seeded anew (a fork copies the server's: every launch would draw the same "random" numbers)."""
    kind, name = target
    sys.argv = [name if kind == "path" else "-m", *args]
    sys.path[0] = os.path.dirname(os.path.abspath(name)) if kind == "path" else cwd
    extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    sys.path[1:1] = extra
    warnings.resetwarnings()
    sys.warnoptions[:] = [option for option in os.environ.get("PYTHONWARNINGS", "").split(",") if option]
    warnings._processoptions(sys.warnoptions)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    torch.seed()  # a new process seeds torch's default generator from the OS, as this does
    reseed_module_rngs()


def reseed_module_rngs() -> None:
    """Reseed, from the OS, random's and numpy's global streams and every module-level random.Random (datasets
    draws its cache fingerprints from one: two launches would otherwise collide in the cache)."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value) is random.Random:
                value.seed()


def run(target: list[str]) -> int:
    """Run the module or script as __main__; its exit code as the interpreter would give it."""
    kind, name = target
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 -- as the interpreter: print the traceback, exit 1
        traceback.print_exc()
        return 1
    return 0
