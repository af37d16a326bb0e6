"""What dsmt's local launcher (toolkit/launch/local.py) watches while its ranks run, through their heartbeats
(LOG_DIR/rankN.heartbeat.json: toolkit/launch/heartbeat.py).

- A hung rank: one whose process exists but whose heartbeat has not moved for `hang_timeout_s` (stopped by SIGSTOP
  or a debugger, or wedged where its heartbeat thread cannot run) is named, and the job is ended at once, every
  rank killed with its helper processes. Without this the others wait out the collective timeout (180 s on the
  CPU, 600 s under NCCL) and torchrun's shutdown wait, and the stopped rank is reported "killed by SIGKILL".
- SIGTERM to the launcher (preemption, a time limit, `kill`) is passed on to the ranks, which finish their step,
  save it and exit 75 (toolkit/train/job/preemption.py); the launcher waits `stop_grace_s` for them, then kills
  them. Whether they all stopped that way is read from their last heartbeat, however the signal reached them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.launch import heartbeat

POLL_S = 1.0  # heartbeats are written every second under this launcher
EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): the same command again resumes the run


class RankHung(DsmtError):
    """A rank stopped reporting; the launcher ended the job."""

    exit_code = 1


class Preempted(DsmtError):
    """The job ended on SIGTERM: run the same command again to resume."""

    exit_code = EXIT_PREEMPTED


class JobWatch:
    """Started with the ranks, stopped once they are gone; `verdict` then says what ended them, if this knows."""

    def __init__(self, *, log_dir: Path, nprocs: int, hang_timeout_s: float | None, stop_grace_s: float):
        self.log_dir, self.nprocs = log_dir, nprocs
        self.hang_timeout_s, self.stop_grace_s = hang_timeout_s, stop_grace_s
        self.torchrun = None  # subprocess.Popen of torchrun; None: a plugged rank runner's ranks (local.py)
        self.hung: str | None = None  # the message naming a hung rank, once the job was ended for it
        self.sigterm_at: float | None = None
        self._done = threading.Event()

    def start(self) -> None:
        if self.hang_timeout_s is not None:
            threading.Thread(target=self._watch_hangs, name="dsmt-hang-watch", daemon=True).start()

    def stop(self) -> None:
        self._done.set()

    def _watch_hangs(self) -> None:
        while not self._done.wait(POLL_S):
            hung = [(rank, record, late_s) for rank, record, late_s
                    in heartbeat.hung_on_this_machine(self.log_dir, older_than_s=self.hang_timeout_s)
                    # a rank that stopped on SIGTERM after saving beats no more while its process ends
                    if heartbeat.saved_checkpoint(str(record.get("phase", ""))) is None]
            if hung:
                rank, record, late_s = hung[0]
                self.hung = hung_message(rank=rank, record=record, late_s=late_s, nprocs=self.nprocs,
                                         hang_timeout_s=self.hang_timeout_s, log_dir=self.log_dir)
                self.end_job()
                return

    def forward_sigterm(self) -> None:
        """SIGTERM to the ranks (through torchrun, which passes it on and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT for
        them), then a timer that ends the job once `stop_grace_s` is spent. Repeats are ignored."""
        if self.sigterm_at is not None:
            return
        self.sigterm_at = time.monotonic()
        if self.torchrun is not None:
            self.torchrun.send_signal(signal.SIGTERM)
        else:
            for pid in rank_pids(self.log_dir):
                _signal(pid, signal.SIGTERM)
        timer = threading.Timer(self.stop_grace_s + POLL_S, lambda: None if self._done.is_set() else self.end_job())
        timer.daemon = True
        timer.start()

    def end_job(self) -> None:
        """SIGKILL every rank, each with its process group and descendants (helpers), then torchrun."""
        import psutil

        for pid in rank_pids(self.log_dir):
            try:
                tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                continue
            if _group_leader(pid):  # torchrun (and a rank runner may) start each rank as its own group
                _signal(pid, signal.SIGKILL, group=True)
            for process in tree:
                _signal(process.pid, signal.SIGKILL)
        if self.torchrun is not None and self.torchrun.poll() is None:
            self.torchrun.kill()

    def verdict(self) -> DsmtError | None:
        """What ended the job (it failed), when it was a hung rank or a SIGTERM; None: read the ranks' own reports."""
        beats = heartbeat.read_all(self.log_dir)
        saved = {rank: heartbeat.saved_checkpoint(str(r.get("phase", ""))) for rank, r in beats.items()}
        if len(beats) == self.nprocs and None not in saved.values():
            return Preempted(f"[preempted] SIGTERM (preemption or time limit): every rank stopped after the same "
                             f"step, saved as {saved[min(saved)]}; exit code {EXIT_PREEMPTED}\n"
                             "fix: run the same command again: it resumes from that checkpoint (nothing is lost)")
        if self.hung is not None:
            return RankHung(self.hung)
        if self.sigterm_at is None or not beats or any(self.log_dir.glob("rank*.error.json")):
            return None  # not a training run's ranks (no heartbeats), or a rank failed with its own error
        phases = ", ".join(f"rank {rank} at {r.get('phase')}" for rank, r in sorted(beats.items()))
        return Preempted(f"[preempted] SIGTERM (preemption or time limit): the ranks did not all stop at a step "
                         f"boundary within {self.stop_grace_s:.0f} s ({phases}) and were ended; the run resumes "
                         f"from its last complete checkpoint; exit code {EXIT_PREEMPTED}\nfix: set "
                         "training.preemption_grace_s (and the launcher's grace: SLURM's --signal=TERM@N) above one "
                         "step plus one checkpoint save of this job")


def hung_message(*, rank: int, record: dict, late_s: float, nprocs: int, hang_timeout_s: float,
                 log_dir: Path) -> str:
    from toolkit.launch.rank_output import rank_log

    pid = int(record["pid"])
    if heartbeat.process_state(pid) in ("T", "t"):
        how = "its process is stopped (SIGSTOP, Ctrl-Z or a debugger)"
    else:
        how = "its process runs but its heartbeat thread cannot (a call that holds Python's GIL, or swapping)"
    return (f"[rank_hung] rank {rank} of {nprocs} (pid {pid}) stopped reporting {late_s:.0f} s ago while "
            f"\"{record.get('phase')}\": {how}; the job was ended (every rank killed)\n"
            f"fix: its output ({rank_log(log_dir, rank)}) ends where it stopped; run the same command again to "
            f"resume from the last checkpoint; a rank paused on purpose (a debugger) needs a larger "
            f"training.hang_timeout_s (now {hang_timeout_s:g} s)")


def rank_pids(log_dir: Path) -> list[int]:
    """This launch's ranks on this machine (the launcher cleared the directory's heartbeats before starting)."""
    return [pid for _, pid in heartbeat.live_on_this_machine(log_dir)]


def _group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _signal(pid: int, sig: int, *, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
