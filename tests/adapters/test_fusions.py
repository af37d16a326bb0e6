"""megatron-core's fused kernels: on where a GPU run has them (decided at build from the device and the layers),
off on the CPU, the compiled ones off with training.fusions: off (then nothing compiles), and named by the dry run. The GPU side is
seen through a mocked CUDA backend: the flags the model is built with, and megatron's own TransformerConfig checks
of them."""

from pathlib import Path

import pytest

from toolkit import backend as backends
from toolkit.adapters import fusions
from toolkit.adapters.build import transformer_config
from toolkit.adapters.hf_config import model_settings
from toolkit.parallel.groups import Layout
from toolkit.models.tiny import tiny_config
from toolkit.spec.load import load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPU_SPEC = CONFIGS / "llama3-8b-finetune-1x8-h100.yaml"


def settings_of(model_type: str):
    return model_settings(tiny_config(model_type))


def test_the_cpu_builds_with_every_fusion_off():
    import torch

    assert backends.current().name == "cpu"
    config = transformer_config(settings=settings_of("llama"), layout=Layout(), params_dtype=torch.float32)
    assert [name for name in fusions.FUSIONS + fusions.NEVER if getattr(config, name)] == []


@pytest.mark.parametrize("model_type, te_layers, expected", [
    ("llama", True, {"bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion"}),  # SwiGLU, RoPE, TE
    ("llama", False, {"bias_activation_fusion", "bias_dropout_fusion"}),  # local layers: no TE RoPE kernel
    ("gpt2", True, {"bias_dropout_fusion"}),  # tanh-GELU has no megatron fusion; learned positions, no RoPE
    ("gemma", True, {"bias_dropout_fusion", "apply_rope_fusion"}),  # GeGLU with tanh: not megatron's fused GeGLU
])
def test_gpu_fusions_follow_the_model_and_the_layers(model_type, te_layers, expected):
    fields = fusions.fusion_fields(settings=settings_of(model_type), device="cuda", te_layers=te_layers,
                                   fused_rope=True)
    assert {name for name, on in fields.items() if on} == expected


def test_encoders_keep_their_layers_unfused():
    from transformers import AutoConfig

    from toolkit.demo.tiny_encoder import TINY_BERT

    settings = model_settings(AutoConfig.for_model("bert", architectures=["BertForMaskedLM"], **TINY_BERT))
    assert not any(fusions.fusion_fields(settings=settings, device="cuda", te_layers=True, fused_rope=True).values())


def test_a_gpu_node_with_transformer_engine_builds_a_config_megatron_accepts(monkeypatch):
    """What `build_model_chunks` gives megatron on a GPU node with TE: the fusions on, and TransformerConfig's own
    validation of them (activation, RoPE kernel present) passes."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(backends, "current", lambda: backends.Backend(name="cuda", dist_backend="nccl",
                                                                      use_transformer_engine=True))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)  # TE's kernel, stood in
    config = transformer_config(settings=settings_of("llama"), layout=Layout(), params_dtype=torch.bfloat16,
                                attention="fused")
    assert (config.bias_activation_fusion, config.bias_dropout_fusion, config.apply_rope_fusion) == (True, True, True)
    assert [name for name in fusions.NEVER if getattr(config, name)] == []  # see toolkit/adapters/fusions.py


def test_the_dry_run_names_the_fusions_of_the_specs_device():
    from toolkit.check import dryrun

    spec = load_spec(GPU_SPEC)
    problem = dryrun.fusion_problem(spec=spec, settings=settings_of("llama"))
    assert problem.message.startswith("cluster.device=cuda, Transformer Engine layers, training.fusions=auto: fused "
                                      "kernels on: bias_activation, bias_dropout, rope; off: none (bias_activation, "
                                      "bias_dropout: megatron compiles them with torch.compile at the first step")
    cpu = dryrun.fusion_problem(spec=load_spec(CONFIGS / "tiny-cpu.yaml"), settings=settings_of("llama"))
    assert cpu.message.endswith("fused kernels on: none; off: bias_activation, bias_dropout, rope")
    off = dryrun.fusion_problem(spec=load_spec(GPU_SPEC, overrides=["training.fusions=off"]),
                                settings=settings_of("llama"))
    assert off.message == ("cluster.device=cuda, Transformer Engine layers, training.fusions=off: fused kernels on: "
                           "rope; off: bias_activation, bias_dropout (training.fusions: off turned off the ones "
                           "megatron compiles: nothing compiles; TE's fused RoPE is a prebuilt kernel and stays)")


def test_the_dry_run_names_the_moe_expert_kernels_and_mla_packing_on_the_unfused_thd_rope():
    from toolkit.check import dryrun

    spec = load_spec(GPU_SPEC)  # Transformer Engine's layers, packed data
    assert spec.data.packing
    (experts,) = dryrun.kernel_path_problems(spec=spec, settings=settings_of("mixtral"))
    assert experts.rule == "moe_experts" and "one GEMM per local expert (4 experts over ep=1)" in experts.message
    assert "grouped GEMM (TEGroupedMLP) is not used" in experts.message
    rules = [p.rule for p in dryrun.kernel_path_problems(spec=spec, settings=settings_of("deepseek_v3"))]
    assert rules == ["moe_experts", "mla_packed_rope"]
    unpacked = load_spec(GPU_SPEC, overrides=["data.packing=false"])
    assert [p.rule for p in dryrun.kernel_path_problems(spec=unpacked, settings=settings_of("deepseek_v3"))] == [
        "moe_experts"]
    assert dryrun.kernel_path_problems(spec=spec, settings=settings_of("llama")) == []


def test_fusions_off_is_read_from_yaml_and_turns_every_compiled_fusion_off(tmp_path):
    """A bare `off` is a YAML 1.1 boolean: it must still mean training.fusions: off, not a validation error."""
    text = GPU_SPEC.read_text().replace("training:\n", "training:\n  fusions: off\n", 1)
    (tmp_path / "job.yaml").write_text(text)
    assert load_spec(tmp_path / "job.yaml").training.fusions == "off"
    assert load_spec(GPU_SPEC).training.fusions == "auto"
    fields = fusions.fusion_fields(settings=settings_of("llama"), device="cuda", te_layers=True, fused_rope=True,
                                   fusions="off")
    # TE's fused RoPE is no torch.compile: it stays, or packed THD records would sync the host in every layer
    assert fields == {**dict.fromkeys(fusions.COMPILED, False), "apply_rope_fusion": True}


def test_a_gpu_node_with_fusions_off_builds_a_config_without_them(monkeypatch):
    import torch

    monkeypatch.setattr(backends, "current", lambda: backends.Backend(name="cuda", dist_backend="nccl",
                                                                      use_transformer_engine=True))
    config = transformer_config(settings=settings_of("llama"), layout=Layout(), params_dtype=torch.bfloat16,
                                attention="local", fusions="off")
    assert [name for name in fusions.FUSIONS + fusions.NEVER if getattr(config, name)] == []


class Built(Exception):
    """Raised by a stand-in builder once it has seen its arguments."""


def test_the_spec_fusions_reach_the_model_builder(monkeypatch, tmp_path):
    """training.fusions from the spec through `build_hybrid` (train, api.initialize) and the checkpoint loaders to
    `build_model_chunks`, for a fine-tune (model.path), a pretraining run (model.builtin) and DPO's frozen
    reference; there, off also switches megatron's other compiled helpers to eager."""
    import torch.distributed as dist

    from toolkit.adapters import build
    from toolkit.convert import chunks
    from toolkit.models.tiny import make_tiny_checkpoint
    from toolkit.spec.load import validate_spec
    from toolkit.train.job.pretrain import hf_config
    from toolkit.train.job.run import build_hybrid

    seen = []

    def builder(**kwargs):
        seen.append(kwargs["fusions"])
        raise Built

    monkeypatch.setattr(chunks, "build_model_chunks", builder)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr("megatron.core.parallel_state.get_pipeline_model_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(backends.Backend, "seed", lambda self, seed: None)  # no process groups here
    raw = load_spec(GPU_SPEC, overrides=["training.fusions=off"]).model_dump(mode="json")
    checkpoint = make_tiny_checkpoint(tmp_path / "hf")
    pretrain = validate_spec(raw, source="test")
    hf_config(pretrain.model.builtin).save_pretrained(tmp_path / "init")
    finetune = validate_spec({**raw, "model": {"path": str(checkpoint)}}, source="test")
    for spec, hf_dir in ((finetune, checkpoint), (pretrain, tmp_path / "init")):
        with pytest.raises(Built):
            build_hybrid(spec=spec, layout=Layout(), hf_dir=hf_dir, ds_config={})
    from toolkit.train.job.preference_run import frozen_chunks  # DPO's frozen reference

    with pytest.raises(Built):
        frozen_chunks(checkpoint=checkpoint, layout=Layout(), params_dtype=None, attention="local", fusions="off")
    assert seen == ["off", "off", "off"]
    monkeypatch.setattr(build, "model_chunks", lambda **_: iter(()))  # no model: only the switch below
    monkeypatch.setattr(fusions, "run_megatron_eagerly", lambda: seen.append("eager"))
    build.build_model_chunks(settings=settings_of("llama"), layout=Layout(), fusions="off")
    assert seen[-1] == "eager"


def test_run_megatron_eagerly_keeps_a_compiled_function_from_compiling(monkeypatch):
    """megatron's jit_fuser functions are torch.compile'd at import: with dynamo's switch off they run eagerly."""
    import torch
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # as on a GPU rank; restored after the test
    torch._dynamo.reset()

    def no_compiler(graph, inputs):
        raise RuntimeError("Failed to find C compiler")

    compiled = torch.compile(lambda x: x * 2 + 1, backend=no_compiler)
    with pytest.raises(Exception, match="Failed to find C compiler"):
        compiled(torch.ones(3))
    fusions.run_megatron_eagerly()
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
