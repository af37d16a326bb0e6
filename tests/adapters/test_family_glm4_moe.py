"""GLM-4.5 (glm4_moe) alone, one process: the table against saved checkpoints (q / k norms and q / k / v biases per
config), the settings read, the partial RoPE against transformers' own, the layer spec without q / k norms, what
is refused, and LoRA's refusal. Logits at TP x PP x EP and round trips: the lead's shared multi-rank tests."""

import pytest
import torch
from safetensors import safe_open

from toolkit.adapters.family import AdapterError, get_family
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.load import check_hf_coverage
from toolkit.models.tiny import make_tiny_checkpoint, tiny_config


@pytest.mark.parametrize("overrides", [{}, dict(use_qk_norm=False, attention_bias=False)])
def test_table_covers_every_tensor_of_a_saved_checkpoint(overrides, tmp_path):
    path = make_tiny_checkpoint(tmp_path / "glm", model_type="glm4_moe", num_hidden_layers=2, **overrides)
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    settings = model_settings(tiny_config("glm4_moe", num_hidden_layers=2, **overrides))
    items = settings.load_items()
    assert check_hf_coverage(items=items, hf_names=names, ignored=settings.ignored_hf()) == []
    assert sorted({hf for item in items.values() for hf in item.hf}) == sorted(names)  # nothing ignored, all used
    # transformers 5 fuses the experts in memory but saves them per expert, as published
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == ("use_qk_norm" not in overrides)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == ("attention_bias" not in overrides)


def test_settings_read_from_the_config():
    settings = model_settings(tiny_config("glm4_moe"))
    fields = settings.transformer_fields
    assert (fields["qk_layernorm"], fields["add_qkv_bias"], fields["add_bias_linear"]) == (True, True, False)
    assert fields["kv_channels"] == 16 and fields["moe_layer_freq"] == [0, 1, 1, 1]
    assert (fields["moe_router_score_function"], fields["moe_router_enable_expert_bias"],
            fields["moe_router_bias_update_rate"], fields["moe_router_dtype"]) == ("sigmoid", True, 0.0, "fp32")
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"], fields["moe_router_topk_scaling_factor"]) \
        == (2, 1, 2.5)
    assert fields["moe_shared_expert_intermediate_size"] == 32 and fields["ffn_hidden_size"] == 96
    assert "multi_latent_attention" not in fields and fields["moe_router_load_balancing_type"] == "none"
    assert settings.quirks == {} and settings.rope_scaling == {"rotary_percent": 0.5}  # GPTModel's argument
    assert settings.passthrough_hf == ("model.layers.4.*",)
    plain = model_settings(tiny_config("glm4_moe", use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0))
    assert not plain.transformer_fields["qk_layernorm"] and not plain.transformer_fields["add_qkv_bias"]
    assert plain.quirks == {} and plain.rope_scaling is None
    # k / topk_group != 2: HF's group rule replaces megatron's, as for DeepSeek-V3
    grouped = model_settings(tiny_config("glm4_moe", n_routed_experts=8, n_group=4, topk_group=2))
    assert grouped.quirks["group_choice"].group_score_topk == 2 and grouped.transformer_fields["moe_router_num_groups"] is None


def test_partial_rotary_equals_transformers():
    """The first half of each head rotates (rotate_half over that half), the rest passes: HF's
    apply_rotary_pos_emb and megatron's unfused RoPE with the rotary GPTModel builds from the settings."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    from toolkit.backend import cpu

    cpu.install()
    config = tiny_config("glm4_moe")
    settings = model_settings(config)
    rotary = RotaryEmbedding(kv_channels=16, rotary_percent=settings.rope_scaling["rotary_percent"],
                             rotary_base=settings.rotary_base, use_cpu_initialization=True)  # as GPTModel builds it
    seq_len = 12
    freqs = rotary(seq_len)  # [s, 1, 1, 8]
    assert freqs.shape[-1] == 8
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, seq_len, 16), torch.randn(2, 2, seq_len, 16)  # HF [b, heads, s, d]
    cos, sin = Glm4MoeRotaryEmbedding(config)(q, torch.arange(seq_len)[None])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    for ours_in, hf_out in ((q, hf_q), (k, hf_k)):
        ours = _apply_rotary_pos_emb_bshd(ours_in.permute(2, 0, 1, 3), freqs)  # megatron [s, b, heads, d]
        assert torch.allclose(ours.permute(1, 2, 0, 3), hf_out, rtol=0, atol=1e-6)
        assert torch.equal(ours.permute(1, 2, 0, 3)[..., 8:], ours_in[..., 8:])  # the second half passes


def test_layer_spec_keeps_qk_norms_only_with_use_qk_norm():
    from toolkit.adapters.families.glm4_moe import edit_glm4_moe_layer_spec
    from toolkit.adapters.layer_specs import local_layer_spec
    from toolkit.adapters.norms import TorchNorm

    spec = local_layer_spec(qk_norm=True, num_experts=4)
    for use_qk_norm, norm in ((True, TorchNorm), (False, None)):
        config = type("Config", (), {"qk_layernorm": use_qk_norm})
        edited = edit_glm4_moe_layer_spec(spec, config=config, settings=None, transformer_engine=False)
        attention = edited.submodules.self_attention.submodules
        assert attention.q_layernorm is norm and attention.k_layernorm is norm


@pytest.mark.parametrize("overrides,message", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false with sigmoid routing"),
    (dict(num_experts_per_tok=1, n_group=1, topk_group=1), "num_experts_per_tok=1 with norm_topk_prob=true"),
    (dict(n_group=3), "n_group=3 does not divide n_routed_experts=4"),
    (dict(n_shared_experts=0), "n_shared_experts=0"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_type 'linear' with partial_rotary_factor=0.5"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type 'yarn'"),
])
def test_configs_megatron_cannot_reproduce_are_refused_by_name(overrides, message):
    with pytest.raises(AdapterError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        model_settings(tiny_config("glm4_moe", **overrides))


def test_lora_adapts_attention_and_the_routed_experts():
    """GLM-4.5's dense and shared-expert MLP names are redirected by PEFT to its routed experts: not offered."""
    from toolkit.train.lora.targets import resolve_targets

    assert [m.name for m in resolve_targets(get_family("glm4_moe"), None)] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]
