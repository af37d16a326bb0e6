"""Start `dsmt train` as a user does, find its ranks, and kill or stop parts of the job
(tests/train/checkpoint/test_faults.py, tests/train/job/test_faults_processes.py).

Ranks are found through their heartbeat files (OUTPUT_DIR/logs/rankN.heartbeat.json: toolkit/launch/heartbeat.py),
which works whether the ranks are torchrun's children or forks of the test session's warm rank servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def start(spec: Path, *extra: str, cold: bool = False, log: Path | None = None) -> subprocess.Popen:
    """`dsmt train SPEC` in its own session; `cold`: through torchrun, not the warm rank servers."""
    env = dict(os.environ)
    if cold:
        env.pop("DSMT_RANK_SERVERS", None)
    out = open(log or spec.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, "-m", "toolkit.cli", "train", str(spec), *extra], cwd=REPO, env=env,
                            start_new_session=True, stdout=out, stderr=subprocess.STDOUT, text=True)


def run(spec: Path, *extra: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit.cli", "train", str(spec), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def output_of(process: subprocess.Popen, spec: Path) -> str:
    return spec.with_suffix(".log").read_text()


def wait_until(predicate, *, timeout_s: float, what: str, process: subprocess.Popen | None = None,
               poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def rank_pids(output_dir: Path, *, nprocs: int) -> dict[int, int]:
    """rank -> pid of this launch's ranks (their heartbeats), {} until every rank beats."""
    pids = {}
    for rank in range(nprocs):
        try:
            pids[rank] = json.loads((output_dir / "logs" / f"rank{rank}.heartbeat.json").read_text())["pid"]
        except (OSError, ValueError):
            return {}
    return pids


def rank_at_step(output_dir: Path, *, rank: int, step: int) -> bool:
    """Whether `rank` is training step `step` or a later one: its heartbeat's phase ("step N", "saving step_N"),
    or a line of metrics.jsonl for step `step` or later (rank 0 writes it once every rank finished that step's
    collectives). Heartbeats are samples, one a second: a short run can train and save between two of them, which
    metrics.jsonl, one line per step, cannot miss."""
    try:
        phase = json.loads((output_dir / "logs" / f"rank{rank}.heartbeat.json").read_text())["phase"]
    except (OSError, ValueError):
        phase = ""
    for prefix in ("step ", "saving step_"):
        if phase.startswith(prefix) and int(phase[len(prefix):]) >= step:
            return True
    return any(record.get("step", 0) >= step for record in _metrics(output_dir))


def _metrics(output_dir: Path) -> list[dict]:
    try:
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # the line being written
            pass
    return records


def job_processes(launcher: subprocess.Popen, output_dir: Path, *, nprocs: int) -> list[psutil.Process]:
    """The launcher, everything under it, the ranks and everything under them."""
    found = {}
    roots = [launcher.pid, *rank_pids(output_dir, nprocs=nprocs).values()]
    for pid in roots:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                found[process.pid] = process
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive
