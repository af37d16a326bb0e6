"""`dsmt demo` (the README's first command) end to end, shortened to 6 training steps: the files its closing
summary names exist, and the console is rank 0's alone."""

import os
import re

import pytest

from toolkit.cli import main as dsmt

pytestmark = pytest.mark.multiproc


def test_demo_leaves_the_files_it_names_and_speaks_once(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("DSMT_VERBOSE", raising=False)
    monkeypatch.chdir(tmp_path)  # the default --workdir is ./dsmt-demo
    assert dsmt(["demo", "--train-steps", "6"]) == 0
    console = capfd.readouterr()
    out, everything = console.out, console.out + console.err
    # a GPU node would refuse the demo's CPU spec; the demo hides the GPUs from itself and its ranks instead
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and "runs on the CPU" in out
    assert "round trip bit-exact: True" in out and "dsmt demo passed" in out

    workdir = tmp_path / "dsmt-demo"
    summary = (workdir / "summary.txt").read_text()
    assert summary in out  # the closing summary is what summary.txt holds
    named = re.findall(r"^  (\S+)  ", summary, flags=re.MULTILINE)
    for required in ("tiny-llama-hf/", "tiny-llama-mcore/", "tiny-llama-export/", "train/final-hf/",
                     "train/loss_curve.png", "plan/memory.png", "plan/pipeline.png", "run/", "summary.txt"):
        assert required in named, (required, named)
    for name in named:
        path = workdir / name
        assert path.is_dir() if name.endswith("/") else path.is_file() and path.stat().st_size > 0, name
    assert (workdir / "train" / "final-hf" / "model.safetensors").is_file()
    assert (workdir / "run" / "launch_torchrun.sh").is_file()

    # rank 0 speaks: one copy of each notice, no other rank's lines, no launcher traceback, no raw dicts
    assert everything.count("dsmt train: tp=1 pp=2") == 1
    assert everything.count("built successfully") <= 1 and "Setting accelerator to CPU" not in everything
    assert "Loading weights" not in everything and "Traceback" not in everything and "{'" not in out
    assert (workdir / "train" / "logs" / "rank3.log").is_file()
