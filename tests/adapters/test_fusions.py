"""megatron-core's fused kernels: on where a GPU run has them (decided at build from the device and the layers),
off on the CPU, and named by the dry run. The GPU side is seen through a mocked CUDA backend: the flags the model is
built with, and megatron's own TransformerConfig checks of them."""

from pathlib import Path

import pytest

from toolkit import backend as backends
from toolkit.adapters import fusions
from toolkit.adapters.build import transformer_config
from toolkit.adapters.hf_config import model_settings
from toolkit.parallel.groups import Layout
from toolkit.models.tiny import tiny_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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
    from toolkit.spec.load import load_spec

    spec = load_spec(CONFIGS / "llama3-8b-finetune-1x8-h100.yaml")
    problem = dryrun.fusion_problem(spec=spec, settings=settings_of("llama"))
    assert problem.message == ("cluster.device=cuda, Transformer Engine layers: fused kernels on: bias_activation, "
                               "bias_dropout, rope; off: none")
    cpu = dryrun.fusion_problem(spec=load_spec(CONFIGS / "tiny-cpu.yaml"), settings=settings_of("llama"))
    assert cpu.message.endswith("fused kernels on: none; off: bias_activation, bias_dropout, rope")
