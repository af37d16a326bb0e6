"""`dsmt preflight` on GPU runs: every node must import Transformer Engine where the layers are TE's, load
DeepSpeed's fused Adam where it is the optimizer, and compile what megatron's fused kernels compile at step 1
(torch.compile: a C compiler, libcuda, Triton) where the run uses them. The probe's facts come from this machine
(no TE here: a real import failure; the compile with torch.compile and the lookups mocked, as on a GPU node without
them); the head's verdicts from facts as a GPU node would report them."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from toolkit.launch import preflight_probe
from toolkit.check.preflight_kernels import compile_problems, kernel_problems
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


NO_COMPILER = ("BackendCompilerFailed <- RuntimeError: Failed to find C compiler. Please specify via CC environment "
               "variable.")  # as a real dynamo failure reads through `error_line`


def failing_compile(fn):
    """torch.compile as on a node without a C compiler: lazy, then dynamo's wrapper around Triton's error."""
    def call(*args):
        try:
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
        except RuntimeError as err:
            failure = type("BackendCompilerFailed", (RuntimeError,), {})("backend='inductor' raised:\n...")
            failure.inner_exception = err
            raise failure from None
    return call


def test_the_probe_reports_a_failed_compile_and_the_missing_pieces(monkeypatch):
    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("TRITON_LIBCUDA_PATH", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    monkeypatch.setattr(preflight_probe.shutil, "which", lambda tool: None)
    listing = "\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n"  # ldconfig -p without libcuda
    monkeypatch.setattr(preflight_probe.subprocess, "run",
                        lambda argv, **_: subprocess.CompletedProcess(argv, 0, listing, ""))
    facts = preflight_probe.fused_compile_facts(device="cpu")  # the GPU stood in: the compile is what fails
    assert facts["error"] == NO_COMPILER
    assert (facts["c_compiler"], facts["libcuda"], facts["skipped"]) == (None, None, None)
    assert isinstance(facts["seconds"], float)


def test_the_probe_finds_the_pieces_as_triton_does(monkeypatch):
    monkeypatch.setenv("CC", "/opt/cc")  # $CC wins over gcc / clang, as in triton/runtime/build.py
    monkeypatch.delenv("TRITON_LIBCUDA_PATH", raising=False)
    listing = "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    monkeypatch.setattr(preflight_probe.subprocess, "run",
                        lambda argv, **_: subprocess.CompletedProcess(argv, 0, listing, ""))
    assert (preflight_probe.c_compiler(), preflight_probe.libcuda_dirs()) == ("/opt/cc", "/usr/lib/x86_64-linux-gnu")
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", "/drivers")
    assert preflight_probe.libcuda_dirs() == "/drivers"
    fake_driver = type("Driver", (), {"libcuda_dirs": staticmethod(lambda: ["/from/triton"])})
    monkeypatch.setitem(__import__("sys").modules, "triton.backends.nvidia.driver", fake_driver)
    assert preflight_probe.libcuda_dirs() == "/from/triton"  # Triton's own lookup where it imports


def test_the_probe_times_a_compile_that_runs_forward_and_backward(monkeypatch):
    inputs = []
    monkeypatch.setattr(torch, "compile", lambda fn: lambda *args: inputs.extend(args) or fn(*args))
    facts = preflight_probe.fused_compile_facts(device="cpu")
    assert facts["error"] is None and facts["seconds"] >= 0
    assert [t.grad is not None for t in inputs] == [True, True]  # the backward ran: megatron compiles it too
    y, bias = torch.randn(2, 8), torch.randn(8)
    assert torch.equal(preflight_probe.bias_swiglu(y, bias),
                       torch.nn.functional.silu((y + bias)[:, :4]) * (y + bias)[:, 4:])  # megatron's formula


def test_the_probe_compiles_in_the_ranks_environment_with_cold_caches(monkeypatch, tmp_path):
    """.deepspeed_env's variables (a CC set through communication.extra_env) are the ranks': the compile sees them;
    and a warm Inductor / Triton cache would let it pass without the C compiler, so it gets fresh ones."""
    monkeypatch.delenv("CC", raising=False)
    seen = {}

    def compile_(fn):
        seen.update({name: os.environ.get(name) for name in ("CC", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
        return fn

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(preflight_probe, "kernel_facts",
                        lambda: {"fused_compile": preflight_probe.fused_compile_facts(device="cpu")})
    (tmp_path / ".deepspeed_env").write_text("CC=/opt/gcc/bin/gcc\n")
    facts = preflight_probe.facts(run_dir=tmp_path, device="cuda")
    assert facts["kernels"]["fused_compile"]["error"] is None
    assert seen["CC"] == "/opt/gcc/bin/gcc" and seen["TORCHINDUCTOR_CACHE_DIR"] == seen["TRITON_CACHE_DIR"]
    assert "dsmt-preflight-compile-" in seen["TRITON_CACHE_DIR"] and not Path(seen["TRITON_CACHE_DIR"]).exists()
    assert "CC" not in os.environ and os.environ.get("TRITON_CACHE_DIR") != seen["TRITON_CACHE_DIR"]  # restored


def compile_node(*, error=None, seconds=12.5, cc=None, libcuda=None, triton="3.5.0") -> dict:
    return {"kernels": {"fused_compile": {"error": error, "seconds": seconds, "c_compiler": cc, "libcuda": libcuda,
                                          "triton": triton, "python_headers": True, "skipped": None}}}


def test_a_failed_compile_is_an_error_naming_the_fix_when_the_run_uses_the_fusions():
    spec = load_spec(GPU_SPEC)  # cuda, training.fusions auto
    answers = {"gpu-a": compile_node(cc="/usr/bin/gcc", libcuda="/usr/lib"),
               "gpu-b": compile_node(error=NO_COMPILER, libcuda="/usr/lib")}
    (problem,) = compile_problems(spec=spec, answers=answers)
    assert (problem.severity, problem.rule) == ("error", "preflight_fused_compile")
    assert problem.message.startswith("gpu-b: torch.compile of a fused bias + SwiGLU")
    assert NO_COMPILER in problem.message
    assert "C compiler: none" in problem.message
    assert problem.fix.startswith("install a C compiler (apt install gcc)") and "libcuda" not in problem.fix
    assert problem.fix.endswith("or set training.fusions: off (megatron's unfused kernels; nothing compiles; the "
                                "elementwise ops run slower)")
    no_libcuda = compile_problems(spec=spec, answers={"gpu-c": compile_node(error="AssertionError: libcuda.so "
                                                                            "cannot found!", cc="/usr/bin/gcc")})
    assert no_libcuda[0].fix.startswith("make libcuda findable (TRITON_LIBCUDA_PATH=")


def test_with_fusions_off_a_failed_compile_is_only_a_note_and_a_good_one_gives_its_seconds():
    off = load_spec(GPU_SPEC, overrides=["training.fusions=off"])
    (note,) = compile_problems(spec=off, answers={"gpu-a": compile_node(error=NO_COMPILER)})
    assert note.severity == "info" and "training.fusions: off: the run compiles nothing" in note.message
    (timed,) = compile_problems(spec=load_spec(GPU_SPEC), answers={"gpu-a": compile_node(seconds=3.0),
                                                                   "gpu-b": compile_node(seconds=21.4)})
    assert (timed.severity, timed.message) == ("info", "2 node(s): torch.compile of a fused bias + SwiGLU, forward "
                                               "and backward (as megatron's fused kernels at step 1) took at most "
                                               "21.4 s (gpu-b)")
    assert compile_problems(spec=load_spec(CONFIGS / "tiny-cpu.yaml"), answers={"a": compile_node(error="x")}) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_probe_compiles_on_this_gpu():
    facts = preflight_probe.fused_compile_facts()
    assert facts["error"] is None, facts
