"""examples/own_loop.py as a user starts it: under torchrun, then resumed under the `deepspeed` launcher (CPU, gloo,
2 ranks, ZeRO-2), with the README's command lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


def launch(launcher: list[str], *args: str, out: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([*launcher, str(REPO / "examples" / "own_loop.py"), "--out", str(out),
                             "--set", f"training.output_dir={out / 'run'}", *args],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=420)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return result.stdout


def step_losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+) loss ([\d.]+)", stdout, re.M)}


def eval_losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for loss, step in re.findall(r"^eval loss ([\d.]+) .* at step (\d+)$", stdout, re.M)}


def test_own_loop_under_torchrun_then_resumed_under_the_deepspeed_launcher(tmp_path):
    from toolkit.launch.ports import free_port

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    first = launch(torchrun, "--steps", "4", out=tmp_path)
    assert list(step_losses(first)) == [1, 2, 3, 4], first
    evaluations = eval_losses(first)
    assert evaluations[4] < evaluations[0] - 0.1, first  # warm-up 1: lr 0 at step 1 only, then it learns
    assert "loads as LlamaForCausalLM" in first and (tmp_path / "checkpoints" / "step_000004").is_dir()

    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                 str(free_port())]
    second = launch(deepspeed, "--steps", "6", "--resume", out=tmp_path)
    assert list(step_losses(second)) == [5, 6], second
    resumed = eval_losses(second)
    assert abs(resumed[4] - evaluations[4]) <= 1e-4, (first, second)  # the checkpoint's weights, evaluated again
    assert "loads as LlamaForCausalLM" in second and (tmp_path / "checkpoints" / "step_000006").is_dir()
