"""`dsmt preflight` on GPU runs: every node must import Transformer Engine where the layers are TE's and load
DeepSpeed's fused Adam where it is the optimizer. The probe's facts come from this machine (no TE here: a real
import failure); the head's verdicts from facts as a GPU node would report them."""

from pathlib import Path

import pytest

from toolkit.launch import preflight_probe
from toolkit.check.preflight import kernel_problems
from toolkit.spec.load import load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPU_SPEC = CONFIGS / "llama3-8b-finetune-1x8-h100.yaml"
TE_MISSING = "ModuleNotFoundError: No module named 'transformer_engine'"


def node(*, te=None, fused_adam=None) -> dict:
    return {"kernels": {"transformer_engine": te, "fused_adam": fused_adam}}


def test_a_node_without_transformer_engine_is_named_when_the_layers_need_it():
    spec = load_spec(GPU_SPEC)  # training.attention auto on cuda: Transformer Engine's layers
    problems = kernel_problems(spec=spec, answers={"gpu-a": node(), "gpu-b": node(te=TE_MISSING)})
    errors = [(p.rule, p.message) for p in problems if p.severity == "error"]
    assert errors == [("preflight_transformer_engine", f"gpu-b: {TE_MISSING}")]
    assert "training.attention: local" in problems[0].fix


def test_local_attention_needs_no_transformer_engine_and_offload_no_fused_adam():
    spec = load_spec(GPU_SPEC, overrides=["training.attention=local", "parallel.offload_optimizer=true"])
    problems = kernel_problems(spec=spec, answers={"gpu-a": node(te=TE_MISSING, fused_adam="not built")})
    assert [p.rule for p in problems] == ["preflight_kernels"]
    assert "no GPU kernels needed" in problems[0].message


def test_fused_adam_that_cannot_load_is_named():
    problems = kernel_problems(spec=load_spec(GPU_SPEC), answers={"gpu-a": node(fused_adam="missing: nvcc")})
    assert [(p.rule, p.message) for p in problems] == [("preflight_fused_adam", "gpu-a: missing: nvcc")]


def test_cpu_runs_check_no_gpu_kernels():
    assert kernel_problems(spec=load_spec(CONFIGS / "tiny-cpu.yaml"), answers={"a": node(te=TE_MISSING)}) == []


def test_the_probe_reports_this_machines_missing_transformer_engine():
    assert preflight_probe.import_error("transformer_engine.pytorch").startswith("ModuleNotFoundError")
    assert preflight_probe.import_error("json") is None


@pytest.mark.parametrize("prebuilt, tools, expected", [
    (False, {"nvcc", "ninja"}, None),  # JIT-buildable: the first rank builds it
    (False, {"ninja"}, "missing: nvcc"),
])
def test_the_probe_says_whether_fused_adam_can_be_had(monkeypatch, prebuilt, tools, expected):
    import shutil

    import deepspeed.git_version_info as installed
    from deepspeed.ops.op_builder import FusedAdamBuilder

    monkeypatch.setitem(installed.installed_ops, "fused_adam", prebuilt)
    monkeypatch.setattr(FusedAdamBuilder, "is_compatible", lambda self, verbose=False: True)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}" if tool in tools else None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    error = preflight_probe.fused_adam_error()
    assert error is None if expected is None else expected in error
