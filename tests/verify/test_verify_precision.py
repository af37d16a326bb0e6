"""`dsmt verify` compares with HF's true-fp32 forward, so its own ranks must not compute in TF32: Transformer
Engine asks cuBLASLt for TF32 on every fp32 GEMM and has no switch but NVIDIA_TF32_OVERRIDE=0 in the process's
environment, read when CUDA's libraries start. These see what a GPU run would get, with no GPU: the environment
the ranks are launched with, and torch's switches after the worker's set-up."""

import json

import pytest
import torch

from toolkit.models.tiny import make_tiny_checkpoint
from toolkit.verify import run as verify_run
from toolkit.verify import worker


def test_ranks_are_launched_with_tf32_off_in_their_environment(tmp_path, monkeypatch):
    launched = {}

    def fake_launch(*, module, args, nprocs, log_dir, timeout_s, env=None):
        launched.update(module=module, env=env or {})
        result_file = args[args.index("--result-file") + 1]
        (tmp_path / "seen").write_text(result_file)
        with open(result_file, "w") as out:
            json.dump([{"max_abs_diff": 0.0}], out)

    monkeypatch.setattr(verify_run, "launch_local_workers", fake_launch)
    checkpoint = make_tiny_checkpoint(tmp_path / "hf")
    verify_run.run_verify(checkpoint=checkpoint, tp=1, pp=1)
    assert launched["module"] == "toolkit.verify.worker"
    assert launched["env"].get("NVIDIA_TF32_OVERRIDE") == "0"


@pytest.fixture
def tf32_on(monkeypatch):
    """torch's TF32 switches on (cuDNN's default), restored afterwards (they are properties, not attributes)."""
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_worker_turns_torch_tf32_off_and_exports_the_override(tf32_on):
    import os

    worker.exact_fp32_math()
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"


@pytest.mark.parametrize("module_name, kind", [("transformer_engine.pytorch.module.linear", "transformer_engine"),
                                               ("megatron.core.tensor_parallel.layers", "local")])
def test_the_result_names_the_layers_it_compared(module_name, kind):
    layer = type("Linear", (torch.nn.Module,), {"__module__": module_name})()
    chunk = torch.nn.Sequential(layer)
    assert worker._layer_kind([chunk]) == kind
