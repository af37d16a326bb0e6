"""Starting torch.distributed jobs from inside dsmt: N local workers (verify, tests) or a 1-process group
(conversion, which needs a process group for megatron's dist_checkpointing)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.launch.job_watch import JobWatch
from toolkit.launch.ports import free_port
from toolkit.launch.watchdog import parent_death_signal
from toolkit.launch.rank_output import (CONSOLE_ENV, LOG_DIR_ENV, clear_reports, launched_failure, verbose,
                                        warnings_shown)


STOP_GRACE_S = 40.0  # torchrun gives its ranks 30 s after SIGTERM before it SIGKILLs them (its default)
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's wait after SIGTERM (older releases: 30 s)
RANK_RUNNER_ENV = "DSMT_RANK_RUNNER"  # module:function that starts the ranks instead of torchrun (run_ranks)


def launch_local_workers(*, module: str, args: list[str], nprocs: int, log_dir: Path, timeout_s: float | None = 900.0,
                         env: dict[str, str] | None = None, stop_grace_s: float | None = None,
                         hang_timeout_s: float | None = None) -> None:
    """Run `python -m module args` on `nprocs` local ranks through torchrun; raise if any rank fails.

    Rank 0 speaks; the other ranks write log_dir/rankN.log, torchrun log_dir/launcher.log, and a failure comes
    back as one RankFailure naming the first failing rank and its error (toolkit/launch/rank_output.py). With
    DSMT_VERBOSE=1 every rank and torchrun keep the console. `stop_grace_s`: how long the ranks get after SIGTERM
    (training.preemption_grace_s) before they are killed; `hang_timeout_s`: a rank whose heartbeat stops this long
    ends the job, named (toolkit/launch/job_watch.py)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nprocs}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--monitor_interval=1",
               "-m", module, *args]
    log_dir.mkdir(parents=True, exist_ok=True)
    clear_reports(log_dir)
    # One BLAS thread per rank: several ranks share few cores, and oversubscription slows gloo collectives.
    child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}),
                 LOG_DIR_ENV: str(log_dir)}
    if stop_grace_s is not None:
        child_env[SHUTDOWN_TIMEOUT_ENV] = str(int(stop_grace_s))
    # megatron and torch print pages of deprecation / fallback warnings per rank; DSMT_SHOW_WARNINGS=1 keeps them.
    if not warnings_shown():
        child_env["PYTHONWARNINGS"] = "ignore"
    quiet = not verbose()
    if quiet:  # torchrun's stderr (its own traceback included) goes to the log; rank 0 takes back this one
        child_env[CONSOLE_ENV] = f"/proc/{os.getpid()}/fd/2"
    sys.stdout.flush()
    sys.stderr.flush()
    watch = JobWatch(log_dir=log_dir, nprocs=nprocs, hang_timeout_s=hang_timeout_s,
                     stop_grace_s=STOP_GRACE_S if stop_grace_s is None else stop_grace_s)
    with open(log_dir / "launcher.log", "w") if quiet else contextlib.nullcontext() as launcher_log:
        try:
            returncode = run_ranks(command, target=["module", module], args=args, nprocs=nprocs, env=child_env,
                                   stderr=launcher_log, timeout_s=timeout_s, watch=watch)
        except subprocess.TimeoutExpired as err:
            raise DsmtError(f"{module} on {nprocs} ranks did not finish within {err.timeout:.0f} s "
                            f"(rank output: {log_dir})") from err
    if returncode == 0:  # SIGTERM or not, the ranks finished
        return
    verdict = watch.verdict()
    if verdict is not None:  # a hung rank, or SIGTERM (the ranks saved and stopped, or not in time)
        raise verdict
    if watch.sigterm_at is not None and not any(log_dir.glob("rank*.error.json")):
        raise SystemExit(128 + signal.SIGTERM)  # ranks without heartbeats (verify) ended on it, as by default
    raise launched_failure(log_dir=log_dir, nprocs=nprocs, returncode=returncode)


def run_ranks(command: list[str], *, target: list[str], args: list[str], nprocs: int, env: dict[str, str],
              stderr=None, stdout=None, timeout_s: float | None, cwd: str | None = None,
              watch: JobWatch | None = None) -> int:
    """Run torchrun's `command` (the ranks: `target`, ["module", name] or ["path", script], with `args`); the exit
    code. With a `watch`, SIGTERM is passed on to the ranks and waited for, and a hung rank ends the job; without,
    SIGTERM stops the ranks and raises SystemExit.

    DSMT_RANK_RUNNER=module:function is where a site or a test harness plugs in its own rank starter: the function,
    imported from PYTHONPATH, is called with this function's arguments but `watch` (which watches its ranks as it
    would torchrun's) and returns their exit code, or None to leave the launch to torchrun."""
    runner = plugged_rank_runner()
    with _on_sigterm(watch), _watching(watch):
        if runner is not None:
            returncode = runner(command, target=target, args=args, nprocs=nprocs, env=env, stdout=stdout,
                                stderr=stderr, timeout_s=timeout_s, cwd=cwd)
            if returncode is not None:
                return returncode
        # torchrun gets SIGTERM when this process dies, however it dies, and stops its ranks (which also watch it:
        # toolkit/launch/watchdog.py).
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, cwd=cwd,
                                   preexec_fn=parent_death_signal())
        if watch is not None:
            watch.torchrun = process
            if watch.sigterm_at is not None:  # SIGTERM came while torchrun was starting: pass it on now
                process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except BaseException:  # a timeout, Ctrl-C, SIGTERM: torchrun stops its ranks on SIGTERM, given the time
            process.terminate()
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise


def plugged_rank_runner():
    """The function RANK_RUNNER_ENV names (run_ranks), or None: torchrun starts the ranks."""
    import importlib

    spec = os.environ.get(RANK_RUNNER_ENV)
    if not spec:
        return None
    module_name, _, function_name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise DsmtError(f"[rank_runner] {RANK_RUNNER_ENV}={spec!r} names no function that imports here ({err})\n"
                        f"fix: set it to module:function with the module on PYTHONPATH, or unset it to start the "
                        f"ranks through torchrun") from err


@contextlib.contextmanager
def _watching(watch: JobWatch | None):
    if watch is None:
        yield
        return
    watch.start()
    try:
        yield
    finally:
        watch.stop()


@contextlib.contextmanager
def _on_sigterm(watch: JobWatch | None):
    """While the ranks run, SIGTERM is passed on to them by `watch` (they stop at a step boundary and save), or,
    without one, raises SystemExit(143) in the main thread so that torchrun is stopped and the callers' `with`
    blocks (the run lock) unwind. Elsewhere (a thread) no handler can be set: SIGTERM keeps its default."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        if watch is None:
            raise SystemExit(128 + signum)
        watch.forward_sigterm()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def single_process_group(*, dist_backend: str):
    """A world of one process on 127.0.0.1, for tools that need torch.distributed but not several ranks."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend=dist_backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        from toolkit.parallel.groups import destroy_process_groups

        destroy_process_groups()
