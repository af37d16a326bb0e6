"""One run per output directory: OUTPUT_DIR/.dsmt-run.lock names the run that writes there.

Two runs into one output_dir overwrite each other's checkpoints and metrics, and nothing fails until a resume loads
a mix of both. The lock is a JSON record {host, pid, started, time, command}; `started` (seconds since boot,
/proc/PID/stat field 22) tells a reused pid from the run's. It is created by `os.link` of a fully written temp file,
which fails if it exists (atomic on POSIX and NFS; no reader sees half a record). A holder gone from this host
(dead, reused pid, zombie) leaves a stale lock that the next run takes over; takers serialize on a second linked
file, .dsmt-run.lock.takeover, so two restarts cannot both take it. Another host's lock counts as live: its pid
cannot be checked from here. Linux only (/proc)."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.launch import identity

LOCK_NAME = ".dsmt-run.lock"
LOCK_ENV = "DSMT_RUN_LOCK"  # set by the launcher that holds the lock: its ranks must not take it again
_FIELDS = {"host": str, "pid": int, "started": (int, float), "time": str, "command": str}
_GUARD_WAIT_S = 5.0  # a takeover holds its guard for milliseconds; longer means its taker is stopped
LEASE_RENEW_S = 30.0  # a holder rewrites `renewed` this often (`Lock.keep_renewed`)
LEASE_S = 300.0  # another host's lock not renewed for this long is stale (generous: clocks and NFS caches differ)


class RunLocked(DsmtError):
    """Another run holds this output directory, or its lock file cannot be judged."""


def lock_path(output_dir: Path) -> Path:
    return Path(output_dir) / LOCK_NAME


def process_start_time(pid: int) -> float | None:
    """Seconds after boot that `pid` started; None when it does not exist or is a zombie (exited, unreaped)."""
    fields = identity.proc_stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):  # field 3, the state
        return None
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22


def _slurm_step() -> str | None:
    """This process's SLURM job step ("JOB.STEP"); None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_STEP_ID', '')}" if job else None


def _is_live(record: dict) -> bool:
    if not identity.same_machine(record):  # another host, or another container's PID namespace
        # A lock of this very SLURM job step: the job was requeued (or its step restarted) onto other nodes, so
        # its holder is gone. Otherwise the holder's lease says: it renews the lock every LEASE_RENEW_S.
        if record.get("slurm_step") and record.get("slurm_step") == _slurm_step():
            return False
        return "renewed" not in record or time.time() - float(record["renewed"]) < LEASE_S
    started = process_start_time(record["pid"])
    return _hidden_process(record["pid"]) if started is None else started == record["started"]


def _hidden_process(pid: int) -> bool:
    """/proc mounted hidepid=2 hides another user's run, which still exists: kill(pid, 0) says so, and it is live."""
    if not 0 < pid <= 4194304:  # kill(0) and kill(-1) would mean process groups; 2**22 caps pid_max
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except OSError:
        pass
    return False  # gone, or a zombie (visible to kill, state Z in /proc)


def _same_holder(a: dict, b: dict) -> bool:
    return all(a[key] == b[key] for key in ("host", "pid", "started"))


def _read(path: Path) -> dict | None:
    """The record in `path`; None when there is no such file; RunLocked when it is not a dsmt lock record."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError as err:
        record, why = None, "empty" if not text.strip() else f"not JSON: {err}"
    if isinstance(record, dict):
        bad = [k for k, kind in _FIELDS.items() if not isinstance(record.get(k), kind)]
        why = f"missing or mistyped {', '.join(bad)}" if bad else ""
    elif record is not None:
        why = f"a JSON {type(record).__name__}, not an object"
    if why:
        raise RunLocked(f"one_run_per_output_dir: the lock file {path} is not a dsmt run lock ({why}); it was "
                        f"edited or written by something else, so whether a run holds {path.parent} is unknown. "
                        f"If no run is writing there, delete {path} and start again.")
    return record


def _read_or_none(path: Path) -> dict | None:
    try:
        return _read(path)
    except RunLocked:  # edited by hand: held by no run we can name
        return None


def _describe(record: dict) -> str:
    return f"pid {record['pid']} on {record['host']}, started {record['time']}, `{record['command']}`"


def _held_error(output_dir: Path, record: dict) -> RunLocked:
    return RunLocked(
        f"one_run_per_output_dir: {output_dir} is in use by another run ({_describe(record)}). Wait for it or stop "
        f"it (`kill {record['pid']}` on {record['host']}); two runs into one output_dir would overwrite each "
        f"other's checkpoints and metrics. For a second run choose another training.output_dir. If that job is "
        f"gone (another host's), delete {lock_path(output_dir)}.")


def _temp_with(output_dir: Path, record: dict) -> Path:
    fd, name = tempfile.mkstemp(dir=output_dir, prefix=LOCK_NAME + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return Path(name)


def _link_new(temp: Path, path: Path) -> bool:
    """Create `path` as a second name of `temp`; False when it exists. The link count, not the reply, decides:
    an NFS server may answer a retransmitted link that succeeded with EEXIST."""
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return temp.stat().st_nlink == 2


class Lock:
    """A held run lock: `release()` (or leaving a `with` block) removes it if it is still this run's.
    `took_over` is the stale record replaced at acquire, else None."""

    def __init__(self, *, path: Path, record: dict, took_over: dict | None = None):
        self.path, self.record, self.took_over = path, record, took_over

    def takeover_line(self) -> str:
        """The notice a run prints when it took a gone run's lock: what it replaced, and why that is safe."""
        if self.took_over is None:
            return ""
        prog = " ".join(self.record["command"].split()[:2])  # "dsmt train", as dsmt prefixes its lines
        return (f"{prog}: took over the lock of a run that is gone ({_describe(self.took_over)}); its incomplete "
                f"checkpoint, if any, is removed at resume")

    def release(self) -> None:
        """Remove the lock file if it still holds this lock's record; a run that took over a lock we lost keeps it."""
        current = _read_or_none(self.path)
        if current is not None and _same_holder(current, self.record):
            self.path.unlink(missing_ok=True)

    def keep_renewed(self) -> Lock:
        """Rewrite the lock's `renewed` time every LEASE_RENEW_S from a daemon thread while this process lives, so
        that other hosts (which cannot see its pid) know it is held; a holder killed without releasing it leaves
        a lock that goes stale after LEASE_S."""
        import threading

        def renew() -> None:
            while True:
                time.sleep(LEASE_RENEW_S)
                current = _read_or_none(self.path)
                if current is None or not _same_holder(current, self.record):
                    return
                try:
                    self.record = {**self.record, "renewed": time.time()}
                    os.replace(_temp_with(self.path.parent, self.record), self.path)
                except OSError:  # a full or vanished disk: the lease lapses, the run goes on
                    pass

        threading.Thread(target=renew, name="dsmt-run-lock", daemon=True).start()
        return self

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(*, output_dir: Path, command: str, pid: int | None = None) -> Lock:
    """Take OUTPUT_DIR's run lock for process `pid` (default: this one), creating the directory; RunLocked when a
    live run holds it. A stale lock (its holder gone from this host) is taken over: see `Lock.took_over`."""
    output_dir, pid = Path(output_dir), os.getpid() if pid is None else pid
    started = process_start_time(pid)
    if started is None:
        raise ValueError(f"pid {pid} is not a running process: a run lock needs a live holder")
    record = {**identity.here(), "pid": pid, "started": started,
              "time": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
              "slurm_step": _slurm_step(), "launch": identity.launch_id(), "renewed": time.time()}
    output_dir.mkdir(parents=True, exist_ok=True)
    temp = _temp_with(output_dir, record)
    try:
        deadline = time.monotonic() + _GUARD_WAIT_S
        while True:
            lock = _try_acquire(output_dir, record, temp, give_up=time.monotonic() > deadline)
            if lock is not None:
                return lock
            time.sleep(0.02)
    finally:
        temp.unlink(missing_ok=True)


def _try_acquire(output_dir: Path, record: dict, temp: Path, *, give_up: bool) -> Lock | None:
    """One attempt; None when the lock vanished or another run is taking it over: try again."""
    path = lock_path(output_dir)
    if _link_new(temp, path):
        return Lock(path=path, record=record)
    current = _read(path)
    if current is None:  # released between our link and our read
        return None
    if _is_live(current):
        raise _held_error(output_dir, current)
    return _take_over(output_dir, record, temp, stale=current, give_up=give_up)


def _take_over(output_dir: Path, record: dict, temp: Path, *, stale: dict, give_up: bool) -> Lock | None:
    """Replace the stale lock, holding the takeover guard so that only one taker replaces what it judged stale."""
    path, guard = lock_path(output_dir), lock_path(output_dir).with_name(LOCK_NAME + ".takeover")
    guard_temp = _temp_with(output_dir, record)  # its own file: `temp`'s link count must mean only the lock
    try:
        guarded = _link_new(guard_temp, guard)
    finally:
        guard_temp.unlink()
    if not guarded:
        _judge_guard(guard, output_dir, give_up=give_up)
        return None
    try:
        current = _read(path)
        if current is None:
            return Lock(path=path, record=record) if _link_new(temp, path) else None
        if not _same_holder(current, stale):  # another taker finished first: it is the holder now
            if _is_live(current):
                raise _held_error(output_dir, current)
            return None
        os.replace(_temp_with(output_dir, record), path)  # a fresh file: `temp` stays for the caller to unlink
        return Lock(path=path, record=record, took_over=stale)
    finally:
        guard.unlink(missing_ok=True)


def _judge_guard(guard: Path, output_dir: Path, *, give_up: bool) -> None:
    """Another run holds the takeover guard: wait for it (return), unless its taker died or will not finish."""
    taker = _read(guard)
    if taker is None or (_is_live(taker) and not give_up):
        return
    state = "is stuck taking" if _is_live(taker) else "died while taking"
    raise RunLocked(f"one_run_per_output_dir: a run ({_describe(taker)}) {state} over the stale lock of "
                    f"{output_dir}, so who holds it is unknown. If no run is writing there, delete {guard} and "
                    f"start again.")


def held_by_launcher(*, output_dir: Path, environ: dict | None = None) -> bool:
    """True when this process runs under the launcher that holds OUTPUT_DIR's lock: environ[LOCK_ENV] names that
    lock file and its holder is alive on this host. Ranks then must not take the lock again."""
    environ = os.environ if environ is None else environ
    named = environ.get(LOCK_ENV)
    path = lock_path(output_dir)
    if not named or Path(named).resolve() != path.resolve():
        return False
    record = _read_or_none(path)
    return record is not None and identity.same_machine(record) and _is_live(record)


def refuse_another_launch(*, output_dir: Path) -> None:
    """For a rank other than 0 under a cluster launcher, before it writes anything into OUTPUT_DIR: RunLocked when
    a live run of ANOTHER launch holds it (this launch's rank 0 may hold it already, or take it next)."""
    record = holder(output_dir)
    if record is not None and record.get("launch") != identity.launch_id():
        raise _held_error(Path(output_dir), record)


def refuse_if_held(*, output_dir: Path) -> None:
    """RunLocked when a live run holds OUTPUT_DIR: `dsmt train` asks before its pre-launch checks (seconds), so a
    second run is refused at once; `acquire` decides for real after them."""
    record = holder(output_dir)
    if record is not None:
        raise _held_error(Path(output_dir), record)


def holder(output_dir: Path) -> dict | None:
    """The live holder's record (for a dry run's "in use by ..."); None when unlocked or stale. RunLocked when
    the lock file cannot be read, as `acquire` would refuse it."""
    record = _read(lock_path(output_dir))
    return record if record is not None and _is_live(record) else None
