"""One way for tests to start a script on N local gloo ranks: `torchrun` on 127.0.0.1, one BLAS thread per rank,
warnings off, the repository importable; a failed launch fails the test with the output's tail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_on_ranks(script: Path | str, *args: str, nprocs: int, timeout: int = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node=nprocs script args...`; `env` adds variables."""
    from toolkit.launch import free_port

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nprocs}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(script), *map(str, args)]
    result = subprocess.run(command, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result
