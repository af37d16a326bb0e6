"""Qwen3-Next in one process: config reading, refusals by name, the torch gated delta rule against transformers' own
and against the one-position-at-a-time definition, and logits at TP 1 against transformers."""

import re

import pytest
import torch

from toolkit.adapters.family import AdapterError
from toolkit.backend import cpu_gdn
from toolkit.adapters.hf_config import model_settings
from toolkit.models.tiny import make_tiny_checkpoint, tiny_config


def test_config_reads_gated_attention_partial_rope_zero_centred_norms_and_moe():
    settings = model_settings(tiny_config("qwen3_next"))
    fields = settings.transformer_fields
    assert fields["attention_output_gate"] and fields["qk_layernorm"] and fields["layernorm_zero_centered_gamma"]
    assert settings.rope_scaling == {"rotary_percent": 0.25}  # 4 of head_dim 16 rotated
    assert fields["moe_layer_freq"] == [1, 1, 0, 1] and fields["moe_shared_expert_gate"]
    assert fields["num_moe_experts"] == 4 and not fields["moe_router_pre_softmax"]  # norm_topk_prob: renormalised
    assert (fields["linear_num_key_heads"], fields["linear_num_value_heads"]) == (2, 4)
    assert settings.quirks["layer_types"][1] == "full_attention"
    items = settings.load_items()
    assert items["decoder.layers.0.self_attention.in_proj_qkvz.weight"].hf == (
        "model.layers.0.linear_attn.in_proj_qkvz.weight",)
    assert items["decoder.layers.1.self_attention.linear_qkv.q.weight"].hf == ("model.layers.1.self_attn.q_proj.weight",)
    assert "decoder.layers.1.self_attention.in_proj_qkvz.weight" not in items
    assert "decoder.layers.2.mlp.linear_fc1.weight" in items and "decoder.layers.2.mlp.router.weight" not in items


@pytest.mark.parametrize("fields,named", [
    (dict(layer_types=["linear_attention", "chunked_attention", "linear_attention", "full_attention"]),
     "layer_types ['chunked_attention']"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "no MoE layer"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
])
def test_unreproduced_fields_are_refused_by_name(fields, named):
    with pytest.raises(AdapterError, match=re.escape(named)):
        model_settings(tiny_config("qwen3_next", **fields))


def test_tp_sizes_that_split_a_head_group_are_refused_by_name():
    from toolkit.adapters.families.qwen3_next import tp_problems

    settings = model_settings(tiny_config("qwen3_next"))
    assert tp_problems(settings=settings, tp_size=2) == []
    problems = tp_problems(settings=settings, tp_size=4)
    assert any("linear_num_key_heads=2" in p and "valid tp: 1, 2" in p for p in problems)


def recurrent_gated_delta_rule(query, key, value, g, beta) -> torch.Tensor:
    """The rule one position at a time, as toolkit/backend/cpu_gdn.py's docstring defines it (slow): the
    reference its chunked form is tested against."""
    out_dtype = query.dtype
    query, key, value, g, beta = cpu_gdn._heads_first_fp32(query, key, value, g, beta)
    state = query.new_zeros(*query.shape[:2], key.shape[-1], value.shape[-1])
    outputs = []
    for t in range(query.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = key[:, :, t]
        predicted = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        state = state + k_t.unsqueeze(-1) * ((value[:, :, t] - predicted) * beta[:, :, t, None]).unsqueeze(-2)
        outputs.append((state * query[:, :, t].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outputs, dim=1).to(out_dtype)


def _rule_inputs(*, seq_len: int):
    torch.manual_seed(0)
    query, key = torch.randn(2, seq_len, 2, 8), torch.randn(2, seq_len, 2, 8)
    value = torch.randn(2, seq_len, 4, 6)  # 2 value heads per key head
    return query, key, value, -2 * torch.rand(2, seq_len, 4), torch.rand(2, seq_len, 4)


@pytest.mark.parametrize("seq_len", [5, 64, 70])  # under, at and across the 64-position chunk
def test_gated_delta_rule_matches_transformers_and_the_recurrence(seq_len):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    query, key, value, g, beta = _rule_inputs(seq_len=seq_len)
    ours = cpu_gdn.chunk_gated_delta_rule(query, key, value, g, beta)
    theirs, _ = hf.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(ours, theirs)
    recurrent = recurrent_gated_delta_rule(query, key, value, g, beta)
    assert (ours - recurrent).abs().max() < 1e-5


def test_causal_conv1d_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    torch.manual_seed(0)
    x, weight = torch.randn(2, 12, 9), torch.randn(12, 4)
    theirs = hf.causal_conv1d_fn(x, weight, None, activation="silu")
    assert torch.equal(cpu_gdn.causal_conv1d(x, weight, activation=torch.nn.functional.silu), theirs)


def test_logits_match_transformers_at_tp1(tmp_path):
    from tests.adapters.one_process import max_logit_gap

    path = make_tiny_checkpoint(tmp_path / "qwen3_next", model_type="qwen3_next", seed=5)
    torch.manual_seed(0)
    assert max_logit_gap(path, tokens=torch.randint(0, 250, (2, 70))) < 1e-4  # 70 tokens: two 64-position chunks


def test_packed_records_each_run_as_alone(tmp_path):
    """Two records packed in one row (the block-diagonal mask dsmt trains packed data with): the DeltaNet's conv and
    state restart at the record boundary, so each record's logits are those of its forward alone."""
    from tests.adapters.one_process import packed_vs_alone_gap

    path = make_tiny_checkpoint(tmp_path / "qwen3_next", model_type="qwen3_next", seed=5)
    assert packed_vs_alone_gap(path, lengths=(21, 30)) < 1e-5
