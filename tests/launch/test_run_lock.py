"""One run per output directory (toolkit/launch/run_lock.py): refusal of a live holder, takeover of a gone one,
release only of one's own lock, the launcher's lock seen from its ranks, and racing takers. No torch, no ranks:
holders are `sleep` processes and forked workers."""

from __future__ import annotations

import json
import multiprocessing
import socket
import subprocess
import time
from pathlib import Path

import pytest

from toolkit.launch import run_lock
from toolkit.launch.run_lock import LOCK_ENV, RunLocked, acquire, held_by_launcher, holder, lock_path

HOST = socket.gethostname()


@pytest.fixture
def sleeper():
    """A live process other than this one, to hold locks."""
    process = subprocess.Popen(["sleep", "30"])
    yield process
    process.kill()
    process.wait()


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _write_lock(output_dir: Path, **fields) -> Path:
    """A lock file as another run would have written it."""
    record = {"host": HOST, "pid": 1, "started": 0.0, "time": "2026-12-06T03:00:00",
              "command": "dsmt train old.yaml", **fields}
    output_dir.mkdir(parents=True, exist_ok=True)
    lock_path(output_dir).write_text(json.dumps(record))
    return lock_path(output_dir)


def _lock_record(output_dir: Path) -> dict:
    return json.loads(lock_path(output_dir).read_text())


def test_acquire_writes_the_record_and_refuses_a_second_run(tmp_path, sleeper):
    output_dir = tmp_path / "runs" / "a"  # parents are created
    lock = acquire(output_dir=output_dir, command="dsmt train job.yaml", pid=sleeper.pid)
    record = _lock_record(output_dir)
    assert record["host"] == HOST and record["pid"] == sleeper.pid
    assert record["started"] == run_lock.process_start_time(sleeper.pid) is not None
    assert record["command"] == "dsmt train job.yaml" and record["time"][:2] == "20"
    assert lock.took_over is None and lock.takeover_line() == ""
    assert sorted(p.name for p in output_dir.iterdir()) == [".dsmt-run.lock"]  # the temp file is gone

    with pytest.raises(RunLocked) as refused:
        acquire(output_dir=output_dir, command="dsmt train other.yaml")
    message = str(refused.value)
    assert refused.value.exit_code == 2
    assert message.startswith(f"one_run_per_output_dir: {output_dir} is in use by another run")
    for part in (f"pid {sleeper.pid} on {HOST}", f"started {record['time']}", "`dsmt train job.yaml`",
                 f"`kill {sleeper.pid}`", "choose another training.output_dir", f"delete {lock_path(output_dir)}"):
        assert part in message, part
    assert _lock_record(output_dir) == record  # the refused run changed nothing
    assert holder(output_dir) == record


def test_release_removes_the_lock_once(tmp_path):
    with acquire(output_dir=tmp_path, command="dsmt train job.yaml") as lock:
        assert lock_path(tmp_path).is_file()
    assert not lock_path(tmp_path).exists()
    lock.release()  # idempotent
    assert holder(tmp_path) is None
    again = acquire(output_dir=tmp_path, command="dsmt train job.yaml")  # free again
    assert _lock_record(tmp_path)["pid"] == again.record["pid"]
    again.release()


def test_a_dead_holder_is_taken_over(tmp_path):
    dead = _dead_pid()
    _write_lock(tmp_path, pid=dead, started=1.0)
    assert holder(tmp_path) is None  # stale: a dry run reports the directory free
    lock = acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    assert lock.took_over["pid"] == dead
    assert _lock_record(tmp_path) == lock.record
    assert lock.takeover_line() == (
        f"dsmt train: took over the lock of a run that is gone (pid {dead} on {HOST}, started 2026-12-06T03:00:00, "
        f"`dsmt train old.yaml`); its incomplete checkpoint, if any, is removed at resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dsmt-run.lock"]  # no temp, no takeover guard left


def test_a_reused_pid_does_not_keep_a_lock(tmp_path, sleeper):
    started = run_lock.process_start_time(sleeper.pid)
    _write_lock(tmp_path, pid=sleeper.pid, started=started - 1.0)  # the pid is alive, but it is another process
    lock = acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    assert lock.took_over["pid"] == sleeper.pid and lock.record["pid"] != sleeper.pid


def test_a_zombie_holder_is_gone(tmp_path):
    process = subprocess.Popen(["sleep", "0.2"])
    started = run_lock.process_start_time(process.pid)
    _write_lock(tmp_path, pid=process.pid, started=started)
    assert holder(tmp_path) is not None  # alive: the lock is held
    deadline = time.monotonic() + 10
    while Path(f"/proc/{process.pid}/stat").read_text().split(") ")[1][0] != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        assert run_lock.process_start_time(process.pid) is None
        assert acquire(output_dir=tmp_path, command="dsmt train job.yaml").took_over["pid"] == process.pid
    finally:
        process.wait()


def test_another_hosts_lock_is_refused_and_names_the_file(tmp_path):
    path = _write_lock(tmp_path, host="node-elsewhere-7", pid=_dead_pid())
    with pytest.raises(RunLocked) as refused:
        acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    assert "on node-elsewhere-7" in str(refused.value)
    assert str(refused.value).endswith(f"If that job is gone (another host's), delete {path}.")
    assert _lock_record(tmp_path)["host"] == "node-elsewhere-7"
    assert holder(tmp_path)["host"] == "node-elsewhere-7"


def test_a_requeued_slurm_job_takes_its_own_lock_from_another_node(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    _write_lock(tmp_path, host="node-before-requeue", pid=_dead_pid(), slurm_step="4242.0")
    lock = acquire(output_dir=tmp_path, command="python -m toolkit.train (rank 0)")
    assert lock.took_over["host"] == "node-before-requeue" and _lock_record(tmp_path)["slurm_step"] == "4242.0"
    lock.release()
    _write_lock(tmp_path, host="node-before-requeue", pid=_dead_pid(), slurm_step="4243.0")  # another job: live
    with pytest.raises(RunLocked):
        acquire(output_dir=tmp_path, command="python -m toolkit.train (rank 0)")


def test_another_hosts_lease_decides(tmp_path):
    """A holder renews its lock (Lock.keep_renewed); another host's lock not renewed within the lease is stale."""
    _write_lock(tmp_path, host="node-elsewhere-7", pid=_dead_pid(), renewed=time.time() - run_lock.LEASE_S - 1)
    lock = acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    assert lock.took_over["host"] == "node-elsewhere-7"
    lock.release()
    _write_lock(tmp_path, host="node-elsewhere-7", pid=_dead_pid(), renewed=time.time())
    with pytest.raises(RunLocked):
        acquire(output_dir=tmp_path, command="dsmt train job.yaml")


def test_a_pid_in_another_container_is_not_judged_from_here(tmp_path):
    """Same hostname (host networking), another PID namespace: its pid cannot be looked up here."""
    _write_lock(tmp_path, pid=_dead_pid(), pidns=-1, renewed=time.time())
    with pytest.raises(RunLocked):
        acquire(output_dir=tmp_path, command="dsmt train job.yaml")


def test_other_ranks_refuse_another_launchs_run(tmp_path, sleeper, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with acquire(output_dir=tmp_path, command="python -m toolkit.train (rank 0)", pid=sleeper.pid):
        run_lock.refuse_another_launch(output_dir=tmp_path)  # this launch's own rank 0 holds it
        monkeypatch.setenv("MASTER_PORT", "29501")
        with pytest.raises(RunLocked, match=f"pid {sleeper.pid}"):
            run_lock.refuse_another_launch(output_dir=tmp_path)


@pytest.mark.parametrize("text, why", [
    ("", "(empty)"), ("{not json", "(not JSON: Expecting property name"), ("[1, 2]", "(a JSON list, not an object)"),
    ('{"host": "h", "pid": "12"}', "missing or mistyped pid, started, time, command")])
def test_an_unreadable_lock_is_refused(tmp_path, text, why):
    path = lock_path(tmp_path)
    path.write_text(text)
    with pytest.raises(RunLocked) as refused:
        acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    message = str(refused.value)
    assert refused.value.exit_code == 2 and why in message
    assert message.startswith(f"one_run_per_output_dir: the lock file {path} is not a dsmt run lock")
    assert f"delete {path} and start again" in message
    assert path.read_text() == text
    with pytest.raises(RunLocked):
        holder(tmp_path)


def test_release_leaves_a_lock_that_another_run_took_over(tmp_path):
    process = subprocess.Popen(["sleep", "30"])
    first = acquire(output_dir=tmp_path, command="dsmt train job.yaml", pid=process.pid)
    process.kill()
    process.wait()
    second = acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    assert second.took_over == first.record
    first.release()  # the gone run's cleanup, late: not its lock any more
    assert _lock_record(tmp_path) == second.record
    second.release()
    assert not lock_path(tmp_path).exists()


def test_held_by_launcher(tmp_path, sleeper):
    output_dir = tmp_path / "out"
    acquire(output_dir=output_dir, command="dsmt train job.yaml", pid=sleeper.pid)
    env = {LOCK_ENV: str(lock_path(output_dir))}
    assert held_by_launcher(output_dir=output_dir, environ=env)
    assert held_by_launcher(output_dir=tmp_path / "out" / ".." / "out", environ=env)  # the same file, spelled apart
    assert not held_by_launcher(output_dir=output_dir, environ={})
    assert not held_by_launcher(output_dir=tmp_path / "other", environ=env)

    _write_lock(output_dir, pid=_dead_pid())  # the launcher is gone: a rank must not trust its lock
    assert not held_by_launcher(output_dir=output_dir, environ=env)
    _write_lock(output_dir, host="node-elsewhere-7", pid=sleeper.pid)  # not this host's launcher
    assert not held_by_launcher(output_dir=output_dir, environ=env)
    lock_path(output_dir).write_text("")
    assert not held_by_launcher(output_dir=output_dir, environ=env)


@pytest.mark.parametrize("guard_holder", ["dead", "stuck"])
def test_a_takeover_guard_left_behind_is_refused(tmp_path, sleeper, monkeypatch, guard_holder):
    """A taker that died (or hangs) between taking the guard and replacing the lock: who holds it is unknown."""
    monkeypatch.setattr(run_lock, "_GUARD_WAIT_S", 0.2)
    _write_lock(tmp_path, pid=_dead_pid(), started=1.0)
    taker = {"pid": _dead_pid()} if guard_holder == "dead" else {
        "pid": sleeper.pid, "started": run_lock.process_start_time(sleeper.pid)}
    guard = tmp_path / ".dsmt-run.lock.takeover"
    guard.write_text(json.dumps({"host": HOST, "started": 1.0, "time": "2026-12-06T03:00:01",
                                 "command": "dsmt train job.yaml", **taker}))
    with pytest.raises(RunLocked) as refused:
        acquire(output_dir=tmp_path, command="dsmt train job.yaml")
    state = "died while taking" if guard_holder == "dead" else "is stuck taking"
    assert f"a run (pid {taker['pid']} on {HOST}, started 2026-12-06T03:00:01" in str(refused.value)
    assert f"{state} over the stale lock of {tmp_path}" in str(refused.value)
    assert str(refused.value).endswith(f"delete {guard} and start again.")
    assert _lock_record(tmp_path)["command"] == "dsmt train old.yaml"  # nothing taken


ROUNDS, RACERS = 20, 4


def _racer(root: str, barrier, results) -> None:
    """Each round: wait for every racer, try the round's directory, report, and hold until every racer tried."""
    for round_ in range(ROUNDS):
        barrier.wait()
        try:
            lock = acquire(output_dir=Path(root) / str(round_), command=f"racer {round_}")
            results.put((round_, "won", lock.record["pid"], bool(lock.took_over)))
        except RunLocked as err:
            results.put((round_, "lost", str(err), False))
        barrier.wait()


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_racing_runs_one_wins(tmp_path, stale):
    if stale:  # every round's directory holds a gone run's lock: the racers take it over at once
        dead = _dead_pid()
        for round_ in range(ROUNDS):
            _write_lock(tmp_path / str(round_), pid=dead, started=1.0)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(RACERS), context.Queue()
    racers = [context.Process(target=_racer, args=(str(tmp_path), barrier, results)) for _ in range(RACERS)]
    for racer in racers:
        racer.start()
    outcomes = [results.get(timeout=60) for _ in range(ROUNDS * RACERS)]
    for racer in racers:
        racer.join(timeout=60)
        assert racer.exitcode == 0
    for round_ in range(ROUNDS):
        won = [o for o in outcomes if o[0] == round_ and o[1] == "won"]
        lost = [o for o in outcomes if o[0] == round_ and o[1] == "lost"]
        assert len(won) == 1 and len(lost) == RACERS - 1, (round_, won, lost)
        assert won[0][3] == stale  # a takeover exactly when the lock was stale
        for _, _, message, _ in lost:  # refused with the winner's name, never "stuck" or "unreadable"
            assert f"is in use by another run (pid {won[0][2]} on {HOST}" in message, message
    assert not list(tmp_path.glob("*/.dsmt-run.lock.*"))  # no temp or guard file left behind
