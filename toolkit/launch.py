"""Starting torch.distributed jobs from inside dsmt: N local workers (verify, tests) or a 1-process group
(conversion, which needs a process group for megatron's dist_checkpointing)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

from toolkit.errors import DsmtError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local_workers(*, module: str, args: list[str], nprocs: int, timeout_s: float = 900.0) -> None:
    """Run `python -m module args` on `nprocs` local ranks through torchrun; raise if any rank fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nprocs}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--monitor_interval=1",
               "-m", module, *args]
    # One BLAS thread per rank: several ranks share few cores, and oversubscription slows gloo collectives.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # megatron and torch print pages of deprecation / fallback warnings per rank; DSMT_SHOW_WARNINGS=1 keeps them.
    if not os.environ.get("DSMT_SHOW_WARNINGS"):
        env["PYTHONWARNINGS"] = "ignore"
    try:
        completed = subprocess.run(command, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise DsmtError(f"{module} on {nprocs} ranks did not finish within {timeout_s:.0f} s") from err
    if completed.returncode != 0:
        raise DsmtError(f"{module} failed on {nprocs} ranks (exit {completed.returncode}); see the rank output above")


@contextlib.contextmanager
def single_process_group(*, dist_backend: str):
    """A world of one process on 127.0.0.1, for tools that need torch.distributed but not several ranks."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend=dist_backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        from toolkit.parallel import destroy_process_groups

        destroy_process_groups()
