"""One way for tests to start a script on N local gloo ranks: `torchrun` on 127.0.0.1 (or the same on the test
session's warm rank servers, toolkit/launch/warm_ranks.py), one BLAS thread per rank, warnings off, the repository
importable; a failed launch fails the test with the output's tail."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_on_ranks(script: Path | str, *args: str, nprocs: int, timeout: int = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node=nprocs script args...`; `env` adds variables."""
    from toolkit.launch.local import run_ranks
    from toolkit.launch.ports import free_port

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nprocs}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(script), *map(str, args)]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        returncode = run_ranks(command, target=["path", str(script)], args=list(map(str, args)), nprocs=nprocs,
                               env=full_env, stdout=stdout, stderr=stderr, timeout_s=timeout, cwd=str(REPO))
        stdout.seek(0)
        stderr.seek(0)
        result = subprocess.CompletedProcess(command, returncode, stdout.read(), stderr.read())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result
