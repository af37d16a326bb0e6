"""Runs the GPU check's cases (scripts/gpu_cases.py says what they are): each case's process in its own process
group, killed as a group on its own timeout, and one result line printed and flushed as each case ends

    PASS name: detail (41 s, host peak RSS 3.2 GB)
    FAIL name: why (180 s, ...)        followed by the tail of its log, indented
    SKIP name: why

so that a hang costs one case and leaves no `dsmt train` behind on the GPU. torchrun starts each rank in a session
of its own, so the group is not all of a case: the case's descendants are snapshotted at every poll (with their
start times, so a reused pid is never signalled) and signalled with the group. Up to `jobs` cases run at once (tiny
models share one GPU well); a case marked `last` runs alone once every other case has ended (the timing run). A
case starts only while the run's budget still holds its expected seconds (and those of the `last` cases); the rest
are skipped by name. The budget counts from when the caller says the run started (gpu_check.sh's own start: its
versions block and the cases' inputs are inside it), and every case still running HARD_SLACK_S after it is killed.

How a case is stopped: on its timeout (a hang), SIGTERM first, SIGKILL after KILL_GRACE_S; a stop the runner decides
on (`stop_when`) and any stop of a `kill_at_once` case is SIGKILL at once, with no SIGTERM: dsmt train answers
SIGTERM by saving a checkpoint at the next step boundary (toolkit/train/job/preemption.py), the very thing a run
stopped for want of disk must not do.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from toolkit.launch.watchdog import parent_death_signal

POLL_S = 0.2
KILL_GRACE_S = 10.0  # after SIGTERM, before SIGKILL: dsmt train passes SIGTERM on to its ranks
HARD_SLACK_S = 45.0  # a running case is stopped this long after the budget ends, whatever its own timeout says
OUTER_MARGIN_S = 20.0  # gpu_check.sh's bound on the runner: this long after the last case must have been stopped
TAIL_LINES = 12


class CaseFailed(Exception):
    """A case's check found a wrong number (its message is the result line's detail)."""


class CaseSkipped(Exception):
    """A case found it cannot run here (its message says why)."""


@dataclasses.dataclass
class Case:
    name: str
    command: list[str] | None  # None: a comparison of earlier cases' files (no process)
    # after a clean exit: the detail (or the detail and lines to print under it); raises CaseFailed / CaseSkipped
    check: Callable[[], str | tuple[str, list[str]]] | None = None
    budget_s: float = 60.0  # expected seconds on one H100 (the plan's budgets sum to under 8 minutes)
    timeout_s: float = 180.0  # the case's process group is killed after this
    needs: tuple[str, ...] = ()  # cases that must have passed first
    after: tuple[str, ...] = ()  # cases that must have ended first, however (the toolchain: warm build caches)
    skip: str | None = None  # why it cannot run on this machine (known before it starts)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    last: bool = False  # runs alone, after every other case
    stop_when: Callable[[], bool] | None = None  # done on purpose when this holds: SIGKILLed at once, then checked
    kill_at_once: bool = False  # its timeout's stop too is SIGKILL at once (no SIGTERM: see the module docstring)


@dataclasses.dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str
    seconds: float = 0.0
    peak_rss_bytes: int | None = None  # the largest resident set of the case's processes (wait4's ru_maxrss)
    tail: list[str] = dataclasses.field(default_factory=list)


def result_line(outcome: Outcome) -> str:
    if outcome.status == "SKIP":
        return f"SKIP {outcome.name}: {outcome.detail}"
    facts = [f"{outcome.seconds:.0f} s"]
    if outcome.peak_rss_bytes:
        facts.append(f"host peak RSS {outcome.peak_rss_bytes / 1e9:.1f} GB")
    return f"{outcome.status} {outcome.name}: {outcome.detail} ({', '.join(facts)})"


def print_outcome(outcome: Outcome) -> None:
    lines = [result_line(outcome)] + [f"    | {line}" for line in outcome.tail]
    print("\n".join(lines), flush=True)


# --- processes -----------------------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) from /proc/PID/stat; None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ... starttime is field 22
    return int(fields[1]), fields[0], int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every living descendant of `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                children.setdefault(found[0], []).append(int(entry))
    family, stack = {}, list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found = _stat(child)
        if found is not None and found[1] != "Z":
            family[child] = found[2]
        stack += children.get(child, [])
    return family


def alive(pid: int, started: int) -> bool:
    """The process `pid` that started at `started` still runs (not gone, not a zombie, not a reused pid)."""
    found = _stat(pid)
    return found is not None and found[1] != "Z" and found[2] == started


def _signal(pid: int, started: int, sig: int) -> None:
    if alive(pid, started):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Running:
    """One case's process: its own session and process group (its pid is the group id), output to a log file."""

    def __init__(self, case: Case, *, log_path: Path, cwd: Path, timeout_s: float, clock=time.monotonic):
        self.case, self.log_path, self.clock = case, log_path, clock
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            # SIGKILL when the runner dies however it dies (dsmt train's torchrun then gets its own SIGTERM)
            self.process = subprocess.Popen(case.command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                            env={**os.environ, **case.env}, start_new_session=True,
                                            preexec_fn=parent_death_signal(signal.SIGKILL))
        self.started = clock()
        self.deadline = self.started + timeout_s
        self.family: dict[int, int] = {}  # every descendant seen: ranks in sessions of their own included
        self.usage = None
        self.stopped_on_purpose = False

    def poll(self) -> bool:
        """True once the process has ended (reaped here, with its resource usage)."""
        pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
        if pid == 0:
            self.family.update(descendants(self.process.pid))
            return False
        self._reaped(status, usage)
        return True

    def _reaped(self, status: int, usage) -> None:
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.usage = usage
        self.stop(grace_s=0.0)  # whatever it left behind in its group or sessions

    def stop(self, *, grace_s: float = KILL_GRACE_S, term: bool = True) -> None:
        """SIGTERM to the group and every descendant seen, SIGKILL to what is left after `grace_s`; reaps. Without
        `term`: SIGKILL at once (nothing of the case gets to act on a signal)."""
        self.family.update(descendants(self.process.pid))
        steps = ((signal.SIGTERM, grace_s),) if term else ()
        for sig, wait_s in steps + ((signal.SIGKILL, 0.0),):
            _signal_group(self.process.pid, sig)
            for pid, started in self.family.items():
                _signal(pid, started, sig)
            end = self.clock() + wait_s
            while self.clock() < end and (self.process.returncode is None or self._family_alive()):
                if self.process.returncode is None:
                    self._try_reap()
                time.sleep(0.05)
        if self.process.returncode is None:
            _, status, usage = os.wait4(self.process.pid, 0)
            self.process.returncode = os.waitstatus_to_exitcode(status)
            self.usage = usage

    def _try_reap(self) -> None:
        pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
        if pid != 0:
            self.process.returncode = os.waitstatus_to_exitcode(status)
            self.usage = usage

    def _family_alive(self) -> bool:
        return any(alive(pid, started) for pid, started in self.family.items())

    @property
    def peak_rss_bytes(self) -> int | None:
        return self.usage.ru_maxrss * 1024 if self.usage is not None else None  # Linux: KiB


def log_tail(path: Path, *, lines: int = TAIL_LINES) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


# --- the schedule --------------------------------------------------------------------------------------------------

def _checked(case: Case, *, seconds: float, peak: int | None, log: Path | None) -> Outcome:
    try:
        detail = case.check() if case.check is not None else "ok"
        detail, tail = detail if isinstance(detail, tuple) else (detail, [])
    except CaseSkipped as why:
        return Outcome(case.name, "SKIP", str(why))
    except CaseFailed as why:
        return Outcome(case.name, "FAIL", str(why), seconds, peak, log_tail(log) if log else [])
    except Exception as err:  # a check that cannot read what the case should have written
        return Outcome(case.name, "FAIL", f"check raised {type(err).__name__}: {err}", seconds, peak,
                       log_tail(log) if log else [])
    return Outcome(case.name, "PASS", detail, seconds, peak, tail)


def _finished(run: Running, *, now: float) -> Outcome:
    seconds = now - run.started
    code = run.process.returncode
    if code != 0 and not run.stopped_on_purpose:
        return Outcome(run.case.name, "FAIL", f"exit code {code} (log {run.log_path})", seconds,
                       run.peak_rss_bytes, log_tail(run.log_path))
    return _checked(run.case, seconds=seconds, peak=run.peak_rss_bytes, log=run.log_path)


def _blocked(case: Case, done: dict[str, Outcome], known: set[str]) -> str | None:
    """Why `case` cannot start at all (a case it needs did not pass, or is not in this run), or None."""
    if case.skip:
        return case.skip
    absent = [name for name in case.needs if name not in known]
    if absent:
        return f"needs {', '.join(absent)}, which this run does not have"
    failed = [f"{name} ({done[name].status})" for name in case.needs if name in done and done[name].status != "PASS"]
    return f"needs {', '.join(failed)}" if failed else None


def run_cases(cases: list[Case], *, log_dir: Path, cwd: Path, jobs: int = 3, budget_s: float = 390.0,
              spent_s: float = 0.0, emit: Callable[[Outcome], None] = print_outcome,
              clock=time.monotonic) -> list[Outcome]:
    """Every case, started in list order where it may start (see the module docstring); the outcomes in the order
    they ended, each emitted at once. `spent_s`: seconds of `budget_s` already gone before this call (the caller's
    set-up: the budget counts from the caller's start)."""
    schedule = Schedule(cases, log_dir=log_dir, cwd=cwd, jobs=jobs, budget_s=budget_s, emit=emit, clock=clock,
                        spent_s=spent_s)
    try:
        while schedule.pending or schedule.running:
            schedule.reap()
            schedule.start_ready()
            if schedule.pending or schedule.running:
                time.sleep(POLL_S)
    finally:  # interrupted (SIGTERM from gpu_check.sh's outer timeout): no case outlives the runner
        for run in schedule.running.values():
            run.stop(grace_s=2.0, term=not run.case.kill_at_once)
    return list(schedule.done.values())


class Schedule:
    def __init__(self, cases: list[Case], *, log_dir: Path, cwd: Path, jobs: int, budget_s: float, emit, clock,
                 spent_s: float = 0.0):
        self.log_dir, self.cwd, self.jobs, self.budget_s, self.emit, self.clock = log_dir, cwd, jobs, budget_s, emit, clock
        start = clock() - max(spent_s, 0.0)  # the caller's start, on this clock
        self.budget_end, self.hard_end = start + budget_s, start + budget_s + HARD_SLACK_S
        self.pending, self.running, self.done = list(cases), {}, {}
        self.known = {case.name for case in cases}

    def end(self, outcome: Outcome) -> None:
        self.done[outcome.name] = outcome
        self.emit(outcome)

    def reap(self) -> None:
        """Ends the cases that exited, stops those past their timeout or done on purpose."""
        for name, run in list(self.running.items()):
            now = self.clock()
            stop_now = run.case.stop_when is not None and run.case.stop_when()
            if stop_now or now >= run.deadline:
                run.stopped_on_purpose = stop_now
                run.stop(term=not (stop_now or run.case.kill_at_once))
                if not stop_now:
                    del self.running[name]
                    why = "the run's budget ended" if run.deadline >= self.hard_end - 1e-6 else "its timeout"
                    self.end(Outcome(name, "FAIL", f"still running after {now - run.started:.0f} s ({why}): its "
                                     f"process group was killed (log {run.log_path})", self.clock() - run.started,
                                     run.peak_rss_bytes, log_tail(run.log_path)))
                    continue
            if run.process.returncode is not None or run.poll():
                del self.running[name]
                self.end(_finished(run, now=self.clock()))

    def start_ready(self) -> None:
        for case in list(self.pending):
            blocked = _blocked(case, self.done, self.known)
            if blocked:
                self.pending.remove(case)
                self.end(Outcome(case.name, "SKIP", blocked))
            elif self._may_start(case):
                self.pending.remove(case)
                self._start(case)

    def _may_start(self, case: Case) -> bool:
        if any(name not in self.done for name in case.needs + case.after if name in self.known):
            return False
        if case.last and (self.running or any(c is not case and not c.last for c in self.pending)):
            return False
        return case.command is None or len(self.running) < self.jobs

    def _start(self, case: Case) -> None:
        reserve = sum(c.budget_s for c in self.pending if c.last)  # `case` is out of pending already
        left = self.budget_end - self.clock() - reserve
        if case.budget_s > left:
            self.end(Outcome(case.name, "SKIP", f"not started: {max(left, 0.0):.0f} s left of the "
                             f"{self.budget_s:.0f} s budget{' (after the last cases)' if reserve else ''}, it "
                             f"needs ~{case.budget_s:.0f} s"))
        elif case.command is None:
            self.end(_checked(case, seconds=0.0, peak=None, log=None))
        else:
            timeout_s = min(case.timeout_s, self.hard_end - self.clock())
            self.running[case.name] = Running(case, log_path=self.log_dir / f"{case.name}.log", cwd=self.cwd,
                                              timeout_s=timeout_s, clock=self.clock)


def outer_timeout_s(*, budget_s: float, spent_s: float) -> int:
    """The bound gpu_check.sh puts on the runner itself, in seconds from now (it catches only a runner that hangs:
    each case's own timeout is cut to the budget's end plus HARD_SLACK_S): the moment every case is stopped (that
    end, then a SIGTERM's KILL_GRACE_S) with OUTER_MARGIN_S for the runner's last lines. At least 30 s."""
    return max(math.ceil(budget_s + HARD_SLACK_S + KILL_GRACE_S + OUTER_MARGIN_S - spent_s), 30)


def summary(outcomes: list[Outcome]) -> str:
    counts = {status: sum(o.status == status for o in outcomes) for status in ("PASS", "FAIL", "SKIP")}
    return ", ".join(f"{count} {status}" for status, count in counts.items())


if __name__ == "__main__":  # not a program: scripts/gpu_cases.py runs the cases
    sys.exit("run scripts/gpu_cases.py")
