"""`dsmt demo` (the README's first command) end to end, shortened to 6 training steps."""

import os

import pytest

from toolkit.cli import main as dsmt

pytestmark = pytest.mark.multiproc


def test_demo_passes_and_hides_gpus(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert dsmt(["demo", "--workdir", str(tmp_path), "--train-steps", "6"]) == 0
    out = capsys.readouterr().out
    # a GPU node would refuse the demo's CPU spec; the demo hides the GPUs from itself and its ranks instead
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and "runs on the CPU" in out
    assert "round trip bit-exact: True" in out and "demo passed" in out
    assert (tmp_path / "train" / "final-hf" / "model.safetensors").is_file()
