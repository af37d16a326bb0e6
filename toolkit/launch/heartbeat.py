"""A heartbeat per rank, so that a failure caused by one rank is blamed on it and not on the rank that noticed.

Each rank's thread rewrites LOG_DIR/rankN.heartbeat.json every INTERVAL_S seconds: its pid, host, the time and
what it is doing ("step 5", "saving step_000008"). The thread keeps beating while the rank waits in a collective
(torch releases the GIL there), so a heartbeat that stops means the process stopped: killed, stopped (SIGSTOP, a
debugger) or wedged in code that holds the GIL. When a rank fails with an error that is only the consequence of
another rank's fault (a peer's connection closed, a collective timed out), `suspects` reads the others'
heartbeats and names the ranks that went silent, and how.
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
_phase = "starting"


def heartbeat_file(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.heartbeat.json"


def set_phase(text: str) -> None:
    """What this rank does now, for the next beat (a rank that stalls is named with it)."""
    global _phase
    _phase = text


def start(*, log_dir: Path, rank: int) -> None:
    """Beat from a daemon thread until the process ends (it needs no stopping)."""
    path = heartbeat_file(log_dir, rank)
    interval_s = INTERVAL_S if os.environ.get("DSMT_LOG_DIR") else SHARED_INTERVAL_S
    record = {"rank": rank, "pid": os.getpid(), **identity.here(), "launch": identity.launch_id(),
              "interval_s": interval_s}
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    except OSError:
        pass

    def beat() -> None:
        while True:
            try:
                temp = path.with_suffix(".tmp")
                temp.write_text(json.dumps({**record, "time": time.time(), "phase": _phase}))
                os.replace(temp, path)
            except OSError:  # a full disk or a vanished log dir must not kill the rank
                pass
            time.sleep(interval_s)

    threading.Thread(target=beat, name="dsmt-heartbeat", daemon=True).start()


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
            return f"its process is stopped (SIGSTOP or a debugger; {where})"
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


def suspects(log_dir: Path, *, me: int) -> list[tuple[int, str]]:
    """(rank, how) of every other rank that went silent, the longest-silent first."""
    now, beats, launch = time.time(), read_all(log_dir), identity.launch_id()
    found = [(float(r["time"]), rank, why_silent(r, now=now)) for rank, r in beats.items()
             if rank != me and r.get("launch", launch) == launch]  # this launch's ranks only
    return [(rank, why) for _, rank, why in sorted(found) if why is not None]
