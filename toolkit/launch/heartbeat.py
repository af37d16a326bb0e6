"""A heartbeat per rank, so that a failure caused by one rank is blamed on it and not on the rank that noticed.

Each rank's thread rewrites LOG_DIR/rankN.heartbeat.json every INTERVAL_S seconds: its pid, host, the time and
what it is doing ("step 5", "saving step_000008"). The thread keeps beating while the rank waits in a collective
(torch releases the GIL there), so a heartbeat that stops means the process stopped: killed, stopped (SIGSTOP, a
debugger) or wedged in code that holds the GIL. When a rank fails with an error that is only the consequence of
another rank's fault (a peer's connection closed, a collective timed out), `suspects` reads the others'
heartbeats and names the ranks that went silent, and how. dsmt's own launcher also reads them while the job runs
(toolkit/launch/job_watch.py): a rank whose heartbeat is older than training.hang_timeout_s ends the job, named.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from toolkit.launch import identity

INTERVAL_S = 1.0  # under dsmt's own launcher (one machine, its local disk)
SHARED_INTERVAL_S = 10.0  # under a cluster launcher: hundreds of ranks write to a shared filesystem
STALE_BEATS = 5  # a heartbeat this many beats late means the rank is not running (another host: no /proc to ask)
# The last phase of a rank that stopped at a step boundary on SIGTERM and saved (toolkit/train/job/preemption.py):
# it exited on purpose, so it is no suspect, and the launcher reads it to tell a preemption from a failure.
STOPPED_ON_SIGTERM = "stopped on SIGTERM"
_STOPPED_AFTER_SAVING = f"{STOPPED_ON_SIGTERM} after saving "
STOPPED_PROCESS = "its process is stopped"  # how `why_silent` begins for a rank stopped by SIGSTOP or a debugger
_phase = "starting"
_beat_file: Path | None = None  # this rank's, once `start` ran
_record: dict = {}


def heartbeat_file(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.heartbeat.json"


def stopped_phase(*, saved: Path) -> str:
    """The last phase of a rank that stopped on SIGTERM once checkpoint `saved` was complete."""
    return f"{_STOPPED_AFTER_SAVING}{saved}"


def saved_checkpoint(phase: str) -> str | None:
    """The checkpoint a `stopped_phase` names; None for any other phase."""
    return phase[len(_STOPPED_AFTER_SAVING):] if phase.startswith(_STOPPED_AFTER_SAVING) else None


def set_phase(text: str, *, now: bool = False) -> None:
    """What this rank does now, for the next beat (a rank that stalls is named with it); `now`: written at once
    (a rank's last phase before it exits, which the next beat would not live to write)."""
    global _phase
    _phase = text
    if now:
        _beat()


def start(*, log_dir: Path, rank: int) -> None:
    """Beat from a daemon thread until the process ends (it needs no stopping)."""
    global _beat_file, _record
    interval_s = INTERVAL_S if os.environ.get("DSMT_LOG_DIR") else SHARED_INTERVAL_S
    _record = {"rank": rank, "pid": os.getpid(), **identity.here(), "launch": identity.launch_id(),
               "interval_s": interval_s}
    _beat_file = heartbeat_file(log_dir, rank)
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    except OSError:
        pass

    def beat() -> None:
        while True:
            _beat()
            time.sleep(interval_s)

    threading.Thread(target=beat, name="dsmt-heartbeat", daemon=True).start()


def _beat() -> None:
    if _beat_file is None:
        return
    try:  # a temporary file per thread: the beating thread and `set_phase(now=True)` may write at once
        temp = _beat_file.with_suffix(f".{threading.get_ident()}.tmp")
        temp.write_text(json.dumps({**_record, "time": time.time(), "phase": _phase}))
        os.replace(temp, _beat_file)
    except OSError:  # a full disk or a vanished log dir must not kill the rank
        pass


def read_all(log_dir: Path) -> dict[int, dict]:
    beats = {}
    for path in Path(log_dir).glob("rank*.heartbeat.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        beats[int(record["rank"])] = record
    return beats


def process_state(pid: int) -> str | None:
    """This host's /proc state letter of `pid` (R, S, T stopped, Z exited, ...), None when it is gone."""
    fields = identity.proc_stat_fields(pid)
    return None if fields is None else fields[0]


def why_silent(record: dict, *, now: float) -> str | None:
    """How the rank of this heartbeat went wrong (None: it looks alive)."""
    late = now - float(record["time"])
    where = f"pid {record['pid']} on {record['host']}, last seen at {record['phase']}"
    if identity.same_machine(record):
        state = process_state(int(record["pid"]))
        if state in (None, "Z", "X"):
            return f"its process exited or was killed ({where})"
        if state in ("T", "t"):
            return f"{STOPPED_PROCESS} (SIGSTOP or a debugger; {where})"
    if late > STALE_BEATS * float(record.get("interval_s", INTERVAL_S)):
        return f"its heartbeat stopped {late:.0f} s ago ({where})"
    return None


def live_on_this_machine(log_dir: Path) -> list[tuple[int, int]]:
    """(rank, pid) of every rank whose heartbeat is in `log_dir` and whose process still runs here (a previous
    launch's ranks that have not finished dying)."""
    return [(rank, int(r["pid"])) for rank, r in sorted(read_all(log_dir).items())
            if identity.same_machine(r) and process_state(int(r["pid"])) not in (None, "Z", "X")]


def earliest_silent(log_dir: Path) -> tuple[int, float] | None:
    """(rank, seconds) when one rank's last beat is older than every other rank's by more than STALE_BEATS of
    its beats: the rank that stopped first, read after the job ended (NCCL's watchdog aborts the ranks from C++,
    so no rank reports; the stalled one stopped beating a whole collective timeout before the others)."""
    beats = sorted((float(r["time"]), rank, float(r.get("interval_s", INTERVAL_S)))
                   for rank, r in read_all(log_dir).items() if r.get("launch", "") == _launch_of(log_dir))
    if len(beats) < 2:
        return None
    (first, rank, interval), (second, _, _) = beats[0], beats[1]
    return (rank, second - first) if second - first > STALE_BEATS * interval else None


def _launch_of(log_dir: Path) -> str:
    """The launch of the newest heartbeat in `log_dir` (the launcher reads its own ranks' files)."""
    beats = read_all(log_dir).values()
    return max(beats, key=lambda r: float(r["time"])).get("launch", "") if beats else ""


def suspects(log_dir: Path, *, me: int, this_machine_only: bool = False) -> list[tuple[int, str]]:
    """(rank, how) of every other rank that went silent, the longest-silent first (a rank that stopped on SIGTERM
    after saving exited on purpose: not one). `this_machine_only`: only ranks whose process this machine can see
    (another node's heartbeat may only look late: a shared filesystem's cache, a long save)."""
    now, beats, launch = time.time(), read_all(log_dir), identity.launch_id()
    found = [(float(r["time"]), rank, why_silent(r, now=now)) for rank, r in beats.items()
             if rank != me and r.get("launch", launch) == launch  # this launch's ranks only
             and not str(r.get("phase", "")).startswith(STOPPED_ON_SIGTERM)
             and (identity.same_machine(r) or not this_machine_only)]
    return [(rank, why) for _, rank, why in sorted(found) if why is not None]


def my_suspects(*, this_machine_only: bool = False) -> list[tuple[int, str]]:
    """`suspects` of this rank's own log directory (none before `start`)."""
    if _beat_file is None:
        return []
    return suspects(_beat_file.parent, me=int(_record["rank"]), this_machine_only=this_machine_only)


def hung_on_this_machine(log_dir: Path, *, older_than_s: float) -> list[tuple[int, dict, float]]:
    """(rank, heartbeat, seconds since its last beat) of every rank whose process still exists here but has not
    beaten for `older_than_s` (never less than STALE_BEATS beats): stopped, or wedged where its heartbeat thread
    cannot run. A rank that exited is not hung (its launcher sees the exit)."""
    now, hung = time.time(), []
    for rank, record in sorted(read_all(log_dir).items()):
        late_s = now - float(record["time"])
        limit_s = max(older_than_s, STALE_BEATS * float(record.get("interval_s", INTERVAL_S)))
        if (late_s > limit_s and identity.same_machine(record)
                and process_state(int(record["pid"])) not in (None, "Z", "X")):
            hung.append((rank, record, late_s))
    return hung
