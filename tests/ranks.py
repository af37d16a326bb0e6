"""One way for tests to start a script on N local gloo ranks: `torchrun` on 127.0.0.1 (or the same on the test
session's warm rank servers, tests/harness/warm_ranks.py), one BLAS thread per rank, warnings off, the repository
and the test's helper folders importable; a failed launch fails the test with the output's tail."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def helper_dirs(script: Path | str) -> list[str]:
    """The directories under tests/ above `script` that hold a conftest.py: pytest (prepend import mode) puts them
    on sys.path, so a test file imports their helpers by name (tests/train/job/x.py: tests/train's train_helpers).
    A rank that runs the file as a script gets only the script's own directory."""
    script = (REPO / script).resolve()  # a relative script is relative to the launch's cwd, the repository
    return [str(folder) for folder in script.parents[1:]
            if folder != TESTS and TESTS in folder.parents and (folder / "conftest.py").exists()]


def run_on_ranks(script: Path | str, *args: str, nprocs: int, timeout: int = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node=nprocs script args...`; `env` adds variables."""
    from toolkit.launch.local import run_ranks
    from toolkit.launch.ports import free_port

    python_path = [*helper_dirs(script), str(REPO), os.environ.get("PYTHONPATH")]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": os.pathsep.join(filter(None, python_path)), **(env or {})}
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
