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
import socket
import threading
import time
from pathlib import Path

INTERVAL_S = 1.0
STALE_AFTER_S = 5 * INTERVAL_S  # a beat this late means the rank is not running (another host: no /proc to ask)
_phase = "starting"
_started: float | None = None  # when this rank started beating: older heartbeats are another launch's


def heartbeat_file(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.heartbeat.json"


def set_phase(text: str) -> None:
    """What this rank does now, for the next beat (a rank that stalls is named with it)."""
    global _phase
    _phase = text


def start(*, log_dir: Path, rank: int) -> None:
    """Beat from a daemon thread until the process ends (it needs no stopping)."""
    global _started
    _started = time.time()
    path = heartbeat_file(log_dir, rank)
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id()}

    def beat() -> None:
        while True:
            try:
                temp = path.with_suffix(".tmp")
                temp.write_text(json.dumps({**record, "time": time.time(), "phase": _phase}))
                os.replace(temp, path)
            except OSError:  # a full disk or a vanished log dir must not kill the rank
                pass
            time.sleep(INTERVAL_S)

    threading.Thread(target=beat, name="dsmt-heartbeat", daemon=True).start()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


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
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def why_silent(record: dict, *, now: float) -> str | None:
    """How the rank of this heartbeat went wrong (None: it looks alive)."""
    late = now - float(record["time"])
    where = f"pid {record['pid']} on {record['host']}, last seen at {record['phase']}"
    if record.get("host") == socket.gethostname() and record.get("boot_id") == _boot_id():
        state = process_state(int(record["pid"]))
        if state in (None, "Z", "X"):
            return f"its process exited or was killed ({where})"
        if state in ("T", "t"):
            return f"its process is stopped (SIGSTOP or a debugger; {where})"
    if late > STALE_AFTER_S:
        return f"its heartbeat stopped {late:.0f} s ago ({where})"
    return None


def suspects(log_dir: Path, *, me: int) -> list[tuple[int, str]]:
    """(rank, how) of every other rank that went silent, the longest-silent first."""
    now, beats = time.time(), read_all(log_dir)
    since = (_started or now) - 2 * STALE_AFTER_S  # ranks start within seconds of each other
    found = [(float(r["time"]), rank, why_silent(r, now=now)) for rank, r in beats.items()
             if rank != me and float(r["time"]) >= since]
    return [(rank, why) for _, rank, why in sorted(found) if why is not None]
