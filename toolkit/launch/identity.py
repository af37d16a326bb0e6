"""Who and where a process is, as the run lock and the heartbeats record it: a pid means something only on the
same host, in the same PID namespace (containers with the host's network share its hostname, not its pids) and
since the same boot; and which launch of a job a rank belongs to (its ranks share the rendezvous address)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def here() -> dict:
    """This process's place: the fields `same_machine` compares."""
    return {"host": socket.gethostname(), "pidns": pid_namespace(), "boot_id": boot_id()}


def same_machine(record: dict) -> bool:
    """Whether `record`'s pid can be looked up in this /proc (fields a record lacks are not held against it)."""
    mine = here()
    return all(record.get(key, mine[key]) == mine[key] for key in mine)


def pid_running(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (another user's counts: kill answers EPERM). A pid means
    nothing on another host: callers that may see one say so (see `same_machine`)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch_id(environ=None) -> str:
    """The same on every rank of one launch, different for another launch: the rendezvous address and the
    launcher's job id (torchrun's run id, SLURM's job id)."""
    environ = os.environ if environ is None else environ
    job = environ.get("TORCHELASTIC_RUN_ID") or environ.get("SLURM_JOB_ID") or ""
    return f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}/{job}"


def proc_stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on, None when there is no such process here. The command name
    (field 2) may hold spaces and parentheses, so the fields start after its last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()
