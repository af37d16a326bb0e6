"""Local ranks that start warm: a fork server per local rank that has imported torch, megatron-core, DeepSpeed,
transformers, datasets and dsmt once, and forks a fresh process for each launch.

Starting a rank costs ~6 s of imports on 2 cores, more than most test launches spend on their checks. A server
pays it once per test session; each launch still gets new processes (megatron's parallel state, DeepSpeed's
globals and every RNG start fresh: nothing survives from one launch to the next), torchrun's environment, and
its output on the caller's stdout / stderr. One server per local rank, each started as its own interpreter,
keeps the ranks' string-hash seeds different, as under torchrun, so a set iterated in a different order on two
ranks still shows.

Plugged into dsmt's launcher through its generic hook, `DSMT_RANK_RUNNER=tests.harness.warm_ranks:run_warm`
(toolkit/launch/local.py `run_ranks`), with `DSMT_RANK_SERVERS=DIR` naming the servers (tests/conftest.py sets both,
and puts the repository on PYTHONPATH so that `dsmt` processes the tests start import this module too): then
`launch_local_workers` and tests/ranks.py use the servers in DIR (`python -m tests.harness.warm_ranks --dir DIR
--local-rank K`, from the repository, starts one). A launch whose environment differs from the servers' in a
variable read at import time (`import_time_env`) starts cold through torchrun instead; DIR/launches.jsonl records
every launch, warm or cold, and why.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from toolkit.launch.ports import free_port
from tests.harness.warm_rank_child import become_rank

SERVERS_ENV = "DSMT_RANK_SERVERS"
RUNNER = "tests.harness.warm_ranks:run_warm"  # the value of toolkit/launch/local.py's RANK_RUNNER_ENV
PRELOAD = ("torch", "torch.distributed", "deepspeed", "megatron.core", "megatron.core.pipeline_parallel",
           "transformers", "datasets", "safetensors.torch", "peft", "toolkit.train.job.run", "toolkit.verify.worker")
# Variables read when the process starts (None) or when a module is imported, so a forked rank would not see
# a new value: a launch that changes one, for a module the servers have imported, starts cold.
IMPORT_TIME_ENV = {"HF_": "huggingface_hub", "TRANSFORMERS_": "transformers", "NVTE_": "transformer_engine",
                   "TORCH_LOGS": "torch", "TORCH_SHOW_CPP_STACKTRACES": "torch", "CUDA_VISIBLE_DEVICES": None,
                   "LD_": None, "MALLOC_": None, "GLIBC_TUNABLES": None, "PYTHONHASHSEED": None, "PYTHONHOME": None,
                   "PYTHONMALLOC": None}


def import_time_env(env: dict[str, str], *, prefixes: list[str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(tuple(prefixes))}


def server_file(directory: Path, local_rank: int, suffix: str) -> Path:
    return Path(directory) / f"rank{local_rank}.{suffix}"


# --- server ------------------------------------------------------------------------------------------------


def serve(*, directory: Path, local_rank: int) -> None:
    """Import PRELOAD, say so in DIR/rankK.json, then fork a manager per connection until the parent exits."""
    import torch

    if torch.cuda.is_available():  # a fork after CUDA's initialisation cannot use CUDA
        refusal = "warm rank servers are for CPU ranks and this machine has CUDA: ranks start through torchrun"
        server_file(directory, local_rank, "refused").write_text(refusal)
        raise SystemExit(refusal)
    from toolkit import backend

    from toolkit.backend import cpu

    # A rank installs the CPU redirections (toolkit/backend/cpu.py) before it imports DeepSpeed, which keeps the
    # torch factories it finds at import (zero.Init calls those): the servers import in the same order, then
    # take the redirections out again, so a rank starts with torch's own functions, as a new interpreter does.
    backend.current()
    for name in PRELOAD:
        importlib.import_module(name)
    cpu.uninstall()
    backend.current.cache_clear()  # the rank's first call installs them again
    import deepspeed.accelerator

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(server_file(directory, local_rank, "sock")))
    listener.listen(64)
    listener.settimeout(2.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # managers are reaped by the kernel
    prefixes = [prefix for prefix, module in IMPORT_TIME_ENV.items() if module is None or module in sys.modules]
    facts = {"pid": os.getpid(), "prefixes": prefixes, "env": import_time_env(dict(os.environ), prefixes=prefixes),
             "accelerator": deepspeed.accelerator.get_accelerator()._name}
    ready = server_file(directory, local_rank, "json")
    ready.with_suffix(".tmp").write_text(json.dumps(facts))
    ready.with_suffix(".tmp").rename(ready)
    while os.getppid() == parent:  # the test session that started this server is gone: stop
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                manage(conn)
            finally:
                os._exit(0)
        conn.close()


def manage(conn: socket.socket) -> None:
    """Receive one rank's request, fork the rank, and answer with its exit code; if the caller hangs up first
    (another rank failed, or a timeout), stop the rank and everything it started."""
    request, fds = receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        become_rank(request, stdout_fd=fds[0], stderr_fd=fds[1])  # never returns
    for fd in fds:
        os.close(fd)
    exited = os.pidfd_open(pid)
    readable, _, _ = select.select([exited, conn], [], [])
    if exited in readable:
        returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with contextlib.suppress(ProcessLookupError):  # what the rank left running would hold the caller's pipes
            os.killpg(pid, signal.SIGKILL)
        conn.sendall(json.dumps({"returncode": returncode}).encode() + b"\n")
        return
    stop_group(pid, exited)


def stop_group(pid: int, exited: int) -> None:
    """SIGTERM the rank's process group, SIGKILL it after 5 s (torchrun's order), and reap the rank."""
    for sig, grace_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        if select.select([exited], [], [], grace_s)[0]:
            break
    os.waitpid(pid, 0)


def send(conn: socket.socket, request: dict, fds: list[int]) -> None:
    payload = json.dumps(request).encode()
    socket.send_fds(conn, [len(payload).to_bytes(8, "little")], fds)
    conn.sendall(payload)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 8, 2)
    while len(header) < 8:
        header += conn.recv(8 - len(header))
    size, payload = int.from_bytes(header, "little"), b""
    while len(payload) < size:
        payload += conn.recv(size - len(payload))
    return json.loads(payload), fds


# --- client ------------------------------------------------------------------------------------------------


def run_warm(command: list[str], *, target: list[str], args: list[str], nprocs: int, env: dict[str, str],
             stdout=None, stderr=None, timeout_s: float | None, cwd: str | None = None) -> int | None:
    """The rank runner dsmt's launcher calls (RUNNER): the launch on forks of the servers, its exit code; None when
    they cannot serve it (recorded cold, with why), and torchrun's `command` starts the ranks instead."""
    why_cold = cold_reason(nprocs=nprocs, env=env)
    if why_cold is None:
        try:  # as subprocess would: the ranks inherit this process's fd 1 and 2 unless given files
            returncode = launch(target=target, args=args, nprocs=nprocs, env=env, cwd=cwd, timeout_s=timeout_s,
                                stdout_fd=1 if stdout is None else stdout.fileno(),
                                stderr_fd=2 if stderr is None else stderr.fileno())
            record(target=target, nprocs=nprocs, warm=True, why=None)
            return returncode
        except TimeoutError as err:
            record(target=target, nprocs=nprocs, warm=True, why=None)
            raise subprocess.TimeoutExpired(command, timeout_s) from err
        except ServerGone as err:
            why_cold = str(err)
    record(target=target, nprocs=nprocs, warm=False, why=why_cold)
    return None


def cold_reason(*, nprocs: int, env: dict[str, str], wait_s: float = 300.0) -> str | None:
    """Why this launch cannot use the servers (None: it can). Waits for servers still importing."""
    directory = os.environ.get(SERVERS_ENV)
    if not directory:
        return f"{SERVERS_ENV} is not set"
    deadline = time.monotonic() + wait_s
    facts = []
    for local_rank in range(nprocs):
        ready = server_file(Path(directory), local_rank, "json")
        refused = server_file(Path(directory), local_rank, "refused")
        while not ready.exists():
            if refused.exists():
                return refused.read_text()
            if not Path(directory).is_dir() or time.monotonic() > deadline:
                return f"no rank server {local_rank} in {directory}"
            time.sleep(0.2)
        facts.append(json.loads(ready.read_text()))
    wanted = import_time_env(env, prefixes=facts[0]["prefixes"])
    differing = sorted(key for key in {*wanted, *facts[0]["env"]} if not same_at_import(
        key, server=facts[0]["env"].get(key), launch=wanted.get(key)))
    if env.get("DS_ACCELERATOR", facts[0]["accelerator"]) != facts[0]["accelerator"]:
        differing.append("DS_ACCELERATOR")
    return f"import-time environment differs: {', '.join(differing)}" if differing else None


def same_at_import(key: str, *, server: str | None, launch: str | None) -> bool:
    """Whether a rank forked from the server sees what a fresh one with the launch's value would. A server runs
    only where torch sees no GPU (`serve`): with CUDA_VISIBLE_DEVICES unset it saw them all, none, so any value
    shows none too, and an empty value hides every GPU under any server."""
    if key == "CUDA_VISIBLE_DEVICES" and (server is None or launch == ""):
        return True
    return server == launch


def torchrun_env(*, rank: int, nprocs: int, port: int) -> dict[str, str]:
    """What torchrun exports to each worker of a one-node job (the store is rank 0's, not an agent's)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
            "ROLE_WORLD_SIZE": str(nprocs), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


class ServerGone(OSError):
    """A server stopped after it said it was ready; nothing was started: the launch can start cold."""


def launch(*, target: list[str], args: list[str], nprocs: int, env: dict[str, str], stdout_fd: int,
           stderr_fd: int, timeout_s: float | None, cwd: str | None = None) -> int:
    """Run `target` (["module", name] or ["path", script]) with `args` on nprocs warm ranks; the first non-zero
    exit code (the other ranks are then stopped, as torchrun does), else 0. Raises TimeoutError."""
    directory, port = Path(os.environ[SERVERS_ENV]), free_port()
    conns: dict[socket.socket, int] = {}
    try:
        for rank in range(nprocs):  # every server answers before any rank starts
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conns[conn] = rank
            try:
                conn.connect(str(server_file(directory, rank, "sock")))
            except OSError as err:
                raise ServerGone(f"rank server {rank} in {directory} does not answer: {err}") from err
        for conn, rank in conns.items():
            request = {"target": target, "args": [str(arg) for arg in args], "cwd": cwd or os.getcwd(),
                       "env": {**env, **torchrun_env(rank=rank, nprocs=nprocs, port=port)}}
            send(conn, request, [stdout_fd, stderr_fd])
        rank, returncode = gather(conns, timeout_s=timeout_s)
        if returncode != 0:  # in torchrun's words, which toolkit/launch/rank_output.py reads when a rank left no report
            os.write(stderr_fd, (f"warm ranks (tests/harness/warm_ranks.py): a rank failed\nRoot Cause (first observed "
                                 f"failure):\n[0]:\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : "
                                 f"{returncode}\n").encode())
        return returncode
    finally:
        for conn in conns:
            conn.close()  # a rank still running is stopped by its manager


def gather(conns: dict[socket.socket, int], *, timeout_s: float | None) -> tuple[int, int]:
    """(rank, exit code) of the first rank to fail, else (0, 0) once every rank exited 0."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = dict(conns)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select(list(pending), [], [], left)
        if not readable:
            raise TimeoutError(f"{len(pending)} of {len(conns)} ranks still running after {timeout_s:.0f} s")
        for conn in readable:
            line = conn.makefile().readline()
            returncode = json.loads(line)["returncode"] if line else 1  # a manager that died says nothing
            del pending[conn]
            if returncode != 0:
                return conns[conn], returncode
    return 0, 0


def record(*, target: list[str], nprocs: int, warm: bool, why: str | None) -> None:
    """One line per launch in DIR/launches.jsonl, for the test session's summary."""
    directory = os.environ.get(SERVERS_ENV)
    if directory and Path(directory).is_dir():
        with open(Path(directory) / "launches.jsonl", "a") as log:
            log.write(json.dumps({"target": target[1], "nprocs": nprocs, "warm": warm, "why": why}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a fork server for local rank K (tests/harness/warm_ranks.py)")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    options = parser.parse_args(argv)
    serve(directory=options.dir, local_rank=options.local_rank)


if __name__ == "__main__":
    main()
