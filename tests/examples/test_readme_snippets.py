"""Every Python snippet of the README, verbatim, as a user pastes it: into a file of its own, run with python or
under torchrun from a fresh working directory (the repository on PYTHONPATH, as an installed dsmt is). Scripts are
plain top-level code with no `if __name__ == "__main__":` guard, as most `train.py` files are: a library that
starts a spawned helper (which re-executes `__main__`) would hang them, so each run has a timeout.

A snippet added to the README without a runner here fails `test_every_snippet_has_a_runner`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def snippet(first_code_line: str) -> str:
    """The one README snippet that contains `first_code_line`."""
    found = [text for text in python_snippets() if first_code_line in text]
    assert len(found) == 1, f"{len(found)} README snippets contain {first_code_line!r}"
    return found[0]


# A line that identifies each snippet -> the test that runs it.
RUNNERS = {
    '"model": {"builtin": "llama3-70b"}': "test_api_snippet_generates_the_70b_run_directory",
    '"model": {"builtin": "tiny-llama"}': "test_cli_commands_snippet_checks_generates_and_trains",
    'run = api.initialize("examples/own_loop.yaml")': "test_own_loop_snippet_saves_and_exports_as_a_plain_script",
    "layout = Layout(tp=2, pp=2, sp=True)": "test_adapters_snippet_builds_the_deepspeed_engine_at_tp2_pp2",
}


def test_every_snippet_has_a_runner():
    unrun = [text.splitlines()[0] for text in python_snippets() if not any(key in text for key in RUNNERS)]
    assert not unrun, f"README python snippets without a runner in this file: {unrun}"


def run_script(code: str, *, cwd: Path, nproc: int = 0, timeout: int = 420) -> str:
    from toolkit.launch.ports import free_port

    script = cwd / "train.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
                     "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    result = subprocess.run([*launcher, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return result.stdout + result.stderr


def test_api_snippet_generates_the_70b_run_directory(tmp_path):
    run_script(snippet('"model": {"builtin": "llama3-70b"}'), cwd=tmp_path)
    ds_config = json.loads((tmp_path / "run-70b" / "ds_config.json").read_text())
    assert ds_config["train_batch_size"] == 512 and (tmp_path / "run-70b" / "job.sbatch").is_file()


@pytest.mark.multiproc
def test_cli_commands_snippet_checks_generates_and_trains(tmp_path):
    output = run_script(snippet('"model": {"builtin": "tiny-llama"}'), cwd=tmp_path)
    assert re.search(r"^True \[[\d.]+, [\d.]+\]$", output, re.M), output
    assert (tmp_path / "run-api" / "ds_config.json").is_file()
    assert (tmp_path / "runs" / "api-tp2" / "final-hf" / "config.json").is_file()


@pytest.mark.multiproc
def test_own_loop_snippet_saves_and_exports_as_a_plain_script(tmp_path):
    """Unguarded, under torchrun, with a checkpoint save and an HF export: megatron's own torch_dist writer would
    start a spawned Manager here that re-runs this script and hangs the save (toolkit/convert/threaded_save.py)."""
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "own_loop.yaml", tmp_path / "examples" / "own_loop.yaml")
    output = run_script(snippet('run = api.initialize("examples/own_loop.yaml")'), cwd=tmp_path, nproc=2)
    rates = [float(rate) for rate in re.findall(r"^step \d+ loss [\d.]+ lr (\S+)$", output, re.M)]
    assert len(rates) == 4 and rates[0] == 0.0 and rates[1] > 0, output  # warmup_steps 1: learning from step 2
    assert "Apex is not installed" not in output and "is deprecated" not in output, output  # megatron's / torch's pages
    out = tmp_path / "examples" / "runs" / "own-loop"
    assert (out / "checkpoints" / "step_000004").is_dir() and (out / "hf" / "config.json").is_file()
    assert {"init-hf", "monitor", "checkpoints", "hf"} <= {path.name for path in out.iterdir()}  # one place


@pytest.mark.multiproc
def test_adapters_snippet_builds_the_deepspeed_engine_at_tp2_pp2(tmp_path):
    """The snippet's inputs as a user has them: an HF checkpoint `llama-hf` and `run/` from `dsmt generate`."""
    from toolkit import api
    from toolkit.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "llama-hf")
    spec = api.job_spec({"model": {"path": str(tmp_path / "llama-hf")}, "data": {"synthetic": True},
                         "cluster": {"gpus_per_node": 4, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
                         "parallel": {"tp": 2, "pp": 2, "sequence_parallel": True},
                         "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_length": 32,
                                      "precision": "fp32", "output_dir": str(tmp_path / "out")}})
    api.generate(spec, out_dir=tmp_path / "run")
    code = snippet("layout = Layout(tp=2, pp=2, sp=True)")
    output = run_script(code + "print('engine', type(engine).__name__)\n", cwd=tmp_path, nproc=4)  # seen per rank
    assert output.count("engine DeepSpeedEngine") == 4, output
