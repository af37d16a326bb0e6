"""dsmt's launcher reading its ranks' heartbeats (toolkit/launch/job_watch.py): a stopped rank is named and every
rank killed; after a SIGTERM, ranks that all saved are a preemption (exit 75). No torchrun: the "ranks" are
`sleep` processes with heartbeat files written here."""

import json
import signal
import subprocess
import time

import pytest

from toolkit.launch import heartbeat, identity
from toolkit.launch.job_watch import JobWatch, Preempted, RankHung
from toolkit.launch.rank_output import launched_failure


def _beat(log_dir, rank, *, pid, age_s, phase):
    record = {"rank": rank, "pid": pid, **identity.here(), "launch": "test", "interval_s": 1.0,
              "time": time.time() - age_s, "phase": phase}
    heartbeat.heartbeat_file(log_dir, rank).write_text(json.dumps(record))


@pytest.fixture
def two_ranks(tmp_path):
    ranks = [subprocess.Popen(["sleep", "120"], start_new_session=True) for _ in range(2)]
    yield ranks
    for process in ranks:
        process.kill()
        process.wait()


def test_a_stopped_rank_is_named_and_every_rank_killed(tmp_path, two_ranks):
    running, stopped = two_ranks
    stopped.send_signal(signal.SIGSTOP)
    _beat(tmp_path, 0, pid=running.pid, age_s=-3600, phase="step 4")  # beats on throughout the test
    _beat(tmp_path, 1, pid=stopped.pid, age_s=8, phase="step 3")
    watch = JobWatch(log_dir=tmp_path, nprocs=2, hang_timeout_s=5, stop_grace_s=30)
    watch.start()
    for process in two_ranks:
        assert process.wait(timeout=30) == -signal.SIGKILL
    watch.stop()
    verdict = watch.verdict()
    assert isinstance(verdict, RankHung) and verdict.exit_code == 1
    first_line = str(verdict).splitlines()[0]
    assert first_line.startswith(f'[rank_hung] rank 1 of 2 (pid {stopped.pid}) stopped reporting '), first_line
    assert first_line.endswith('while "step 3": its process is stopped (SIGSTOP, Ctrl-Z or a debugger); the job was '
                               'ended (every rank killed)'), first_line
    assert "training.hang_timeout_s (now 5 s)" in str(verdict)


def test_ranks_that_all_saved_on_sigterm_are_a_preemption(tmp_path):
    watch = JobWatch(log_dir=tmp_path, nprocs=2, hang_timeout_s=None, stop_grace_s=90)
    _beat(tmp_path, 0, pid=1, age_s=0, phase=heartbeat.stopped_phase(saved=tmp_path / "step_000005"))
    _beat(tmp_path, 1, pid=1, age_s=0, phase="step 5")
    assert watch.verdict() is None  # a failure, not a preemption: the ranks' own reports say what
    watch.sigterm_at = time.monotonic()  # ... unless the launcher passed on a SIGTERM: not in time
    late = watch.verdict()
    assert isinstance(late, Preempted) and late.exit_code == 75, late
    assert "did not all stop at a step boundary within 90 s (rank 0 at stopped on SIGTERM" in str(late)
    assert "rank 1 at step 5" in str(late)
    (tmp_path / "rank1.error.json").write_text("{}")
    assert watch.verdict() is None  # a rank's own error wins

    _beat(tmp_path, 1, pid=1, age_s=0, phase=heartbeat.stopped_phase(saved=tmp_path / "step_000005"))
    saved = watch.verdict()
    assert isinstance(saved, Preempted) and saved.exit_code == 75
    assert str(saved).startswith("[preempted] SIGTERM (preemption or time limit): every rank stopped after the "
                                 f"same step, saved as {tmp_path / 'step_000005'}; exit code 75\nfix: "), saved


def test_a_rank_seen_stopped_is_not_said_killed_by_sigkill(tmp_path):
    """The collective-timeout path (collective_timeout_s below hang_timeout_s): rank 0 timed out waiting for a
    stopped rank 1, which torchrun then SIGKILLed; the first line says it was stopped."""
    stopped = "its process is stopped (SIGSTOP or a debugger; pid 7 on h, last seen at step 19)"
    report = {"rank": 0, "host": "h", "command": "dsmt train", "traceback": "", "exit_code": 1, "time": 1.0,
              "message": f"RuntimeError: Timed out waiting 6000ms for recv\n  rank 1 failed first: {stopped}",
              "consequence": True, "suspects": [1], "suspect_reasons": {"1": stopped}}
    (tmp_path / "rank0.error.json").write_text(json.dumps(report))
    (tmp_path / "launcher.log").write_text(
        "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 6)\n"
        "Other Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)\n")
    first_line = str(launched_failure(log_dir=tmp_path, nprocs=2, returncode=1)).splitlines()[0]
    assert first_line.startswith("rank 1 of 2 failed first (its process was stopped: SIGSTOP or a debugger; it was "
                                 "killed when the job ended)"), first_line
