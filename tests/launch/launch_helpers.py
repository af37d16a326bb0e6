"""Shared by the real-launcher tests: find the launcher programs (skip, or fail under DSMT_REQUIRE_LAUNCHERS=1),
build a tiny CPU run directory on a free port, stop a daemon, and check what its training wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.generate.writer import write_run_dir

from toolkit.check.job import check_job
from toolkit.launch.ports import free_port
from toolkit.spec.load import validate_spec

REPO = Path(__file__).parents[2]
TINY_CPU = REPO / "configs" / "tiny-cpu.yaml"


def require_programs(*programs: str, root_for: str = "") -> dict[str, str]:
    """name -> path for each program (PATH, then /usr/sbin and /sbin where Debian puts the daemons; an absolute path
    is checked as it is). Missing ones, or not running as root when `root_for` says what needs root, skip the test,
    or fail it when DSMT_REQUIRE_LAUNCHERS=1 (CI installs them with scripts/install_launchers.sh)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = {name: shutil.which(name, path=search) for name in programs}
    missing = sorted(name for name, path in found.items() if path is None)
    if root_for and os.geteuid() != 0:
        missing.append(f"root ({root_for})")
    if missing:
        message = f"missing {', '.join(missing)}: run scripts/install_launchers.sh, and the tests, as root"
        if os.environ.get("DSMT_REQUIRE_LAUNCHERS") == "1":
            pytest.fail(f"DSMT_REQUIRE_LAUNCHERS=1 but {message}")
        pytest.skip(message)
    return found  # type: ignore[return-value]


def stop_process(proc: subprocess.Popen, *, timeout_s: float = 10) -> None:
    """Terminate `proc`, and kill it if it has not exited within timeout_s; wait for it either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def tiny_spec(*, output_dir: Path, train_steps: int, cluster: dict | None = None,
              training: dict | None = None) -> dict:
    """configs/tiny-cpu.yaml (1 node x 2 CPU ranks) on a free master port, trained for `train_steps` with a checkpoint
    at the last step, output in output_dir; `cluster` and `training` override keys of those sections."""
    raw = yaml.safe_load(TINY_CPU.read_text())
    raw["cluster"] = {**raw["cluster"], "master_port": free_port(), **(cluster or {})}
    raw["training"] = {**raw["training"], "output_dir": str(output_dir), "train_steps": train_steps,
                       "checkpoint_interval": train_steps, **(training or {})}
    return raw


def write_run(raw: dict, run: Path, *, source: str) -> Path:
    """Validate the spec `raw` and write its run directory `run`; returns `run`."""
    write_run_dir(job=check_job(validate_spec(raw, source=source)), out_dir=run)
    return run


def tiny_run_dir(tmp_path: Path, *, train_steps: int, cluster: dict | None = None) -> Path:
    """tiny_spec with output under tmp_path/out, written to the run directory tmp_path/run (returned)."""
    raw = tiny_spec(output_dir=tmp_path / "out", train_steps=train_steps, cluster=cluster)
    return write_run(raw, tmp_path / "run", source="tiny-cpu")


def launch_env(**extra: str) -> dict[str, str]:
    """This environment with the venv's programs first on PATH (torchrun, deepspeed) and the repo importable."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), **extra}


def check_training_output(out: Path, *, train_steps: int) -> None:
    """metrics.jsonl has every step with a positive loss, the last step's checkpoint is complete, HF export exists."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, train_steps + 1)), metrics
    assert all(m["loss"] > 0 for m in metrics), metrics
    assert (out / "checkpoints" / f"step_{train_steps:06d}" / "dsmt_complete.json").is_file()
    assert (out / "final-hf" / "model.safetensors").is_file()
