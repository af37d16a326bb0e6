"""The planner on the families of issue 49: parameter counts equal transformers' models layer by layer (GPT-OSS's
attention and expert biases, sinks and router bias; GLM-4.5's DeepSeek-style MoE on grouped-query attention with
q / k / v biases; Seed-OSS's q / k / v biases without an output bias), the per-rank tensors at tp 2, and the
published totals of gpt-oss-20b / 120b."""

from __future__ import annotations

import pytest

from toolkit.adapters.model_shape import load_model_shape
from toolkit.models.shapes import BUILTIN_SHAPES
from toolkit.plan.experts import expert_tensors
from toolkit.plan.layers import layer_tensors
from toolkit.plan.layout import PlanLayout
from toolkit.plan.memory import stage_params_per_gpu

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24)  # head_dim x heads (96) wider than hidden, as in the releases


def _tiny_configs():
    import transformers

    return {
        "gpt_oss": transformers.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                             layer_types=["sliding_attention", "full_attention"] * 1 + ["full_attention"]),
        "glm4_moe": transformers.Glm4MoeConfig(**SMALL, moe_intermediate_size=32, n_routed_experts=4,
                                               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                               attention_bias=True),
        "seed_oss": transformers.SeedOssConfig(**SMALL, attention_bias=True, attention_out_bias=False),
        "seed_oss_no_bias": transformers.SeedOssConfig(**SMALL, attention_bias=False),
        "qwen2": transformers.Qwen2Config(**SMALL),  # q / k / v biases with no config field saying so
    }


@pytest.mark.parametrize("name", ["gpt_oss", "glm4_moe", "seed_oss", "seed_oss_no_bias", "qwen2"])
def test_param_count_equals_the_hf_model(name, tmp_path):
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()[name]
    config.save_pretrained(tmp_path)
    shape = load_model_shape(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    for i, layer in enumerate(model.model.layers):
        assert sum(p.numel() for p in layer.self_attn.parameters()) == shape.attention_params(), i
        assert sum(p.numel() for p in layer.mlp.parameters()) == shape.mlp_params(moe=shape.is_moe_layer(i)), i
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    # the per-rank tensors at tp = pp = ep = 1 are the whole model (vocabulary 256: no padding rows)
    assert stage_params_per_gpu(shape=shape, layout=PlanLayout(tp=1, pp=1, dp=4), stage=0) == shape.num_params()


def test_gpt_oss_pieces_per_tp_rank():
    """tp 2 on gpt-oss-120b: the sinks split with the query heads, the output and fc2 biases whole, fc1's bias
    split with its rows, the router's bias whole."""
    shape = BUILTIN_SHAPES["gpt-oss-120b"]
    attention, expert = layer_tensors(shape=shape, tp=2, moe=True), expert_tensors(shape=shape, tp=2)
    assert (attention["attention_sinks"], attention["linear_proj_bias"], attention["router_bias"]) == (32, 2880, 128)
    assert attention["linear_qkv_bias"] == (32 + 2 * 4) * 64
    assert (expert["expert_fc1_bias"], expert["expert_fc2_bias"]) == (2 * 1440, 2880)


@pytest.mark.parametrize("name, total_b, active_b", [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)])
def test_gpt_oss_published_totals(name, total_b, active_b):
    """The model card's totals (20.9 B, 116.8 B) and active counts (3.6 B, 5.1 B: the output layer counted, the
    input embedding, a lookup, not; dsmt's active_params counts both)."""
    shape = BUILTIN_SHAPES[name]
    assert shape.num_params() / 1e9 == pytest.approx(total_b, abs=0.01)
    active = shape.active_params() - shape.vocab_size * shape.hidden_size
    assert active / 1e9 == pytest.approx(active_b, abs=0.01)
