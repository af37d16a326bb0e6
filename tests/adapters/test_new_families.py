"""Granite, OLMo-2 and StarCoder2 pieces alone (one process): their config reading and refusals, OLMo-2's norms
against HF's Olmo2RMSNorm, and Granite's scaled bias-dropout-add and hooks. Logits at TP x PP are in
test_parity_multiproc.py, round trips in test_convert.py, training and LoRA in tests/train."""

import pytest
import torch

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_config import model_settings
from toolkit.tiny import tiny_config


def test_granite_reads_its_four_scalars():
    settings = model_settings(tiny_config("granite"))
    assert settings.transformer_fields["softmax_scale"] == 0.2
    multipliers = settings.multipliers
    assert (multipliers.embedding, multipliers.residual, multipliers.logits_divisor) == (3.0, 0.6, 2.5)
    assert model_settings(tiny_config("llama")).multipliers.residual == 1.0


def test_starcoder2_reads_norm_window_and_dropout():
    fields = model_settings(tiny_config("starcoder2", residual_dropout=0.1, embedding_dropout=0.1)).transformer_fields
    assert fields["window_size"] == (7, 0) and fields["window_attn_skip_freq"] == [1, 1, 1, 1]
    assert fields["layernorm_epsilon"] == 1e-5 and fields["hidden_dropout"] == 0.1
    assert fields["add_bias_linear"] and not fields["gated_linear_unit"] and fields["normalization"] == "LayerNorm"


@pytest.mark.parametrize("model_type,fields,named", [
    ("starcoder2", dict(use_bias=False), "use_bias=False"),
    ("starcoder2", dict(embedding_dropout=0.1), "embedding_dropout=0.1 != residual_dropout=0.0"),
    ("granite", dict(mlp_bias=True), "mlp_bias=True"),
    ("granite", dict(attention_bias=True), "attention_bias=True"),
    ("olmo2", dict(attention_bias=True), "attention_bias=True"),
    ("olmo2", dict(attention_dropout=0.1), "attention_dropout=0.1"),
])
def test_unreproduced_fields_are_refused_by_name(model_type, fields, named):
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace(".", r"\.")):
        model_settings(tiny_config(model_type, **fields))


class _Config:
    """The TransformerConfig fields the OLMo-2 norms read."""

    def __init__(self, **fields):
        self.params_dtype, self.sequence_parallel, self.tensor_model_parallel_size = torch.float32, False, 1
        self.layernorm_epsilon, self.hidden_size = 1e-6, 12
        self.__dict__.update(fields)


def test_olmo2_projection_norm_equals_hf_norm_over_the_whole_projection():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from toolkit.adapters.families.olmo2 import KeyProjectionRMSNorm, ProjectionRMSNorm

    torch.manual_seed(0)
    config = _Config(num_attention_heads=4, num_query_groups=2)
    for norm_class, heads in ((ProjectionRMSNorm, 4), (KeyProjectionRMSNorm, 2)):
        ours, hf = norm_class(config, hidden_size=8, eps=1e-6), Olmo2RMSNorm(heads * 8, eps=1e-6)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(heads * 8))
            hf.weight.copy_(ours.weight)
        x = 3 * torch.randn(5, 2, heads, 8)  # megatron's [s, b, heads, head_dim]
        expected = hf(x.reshape(5, 2, heads * 8)).reshape(x.shape)
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-6)
        per_head = Olmo2RMSNorm(8, eps=1e-6)(x)  # Qwen3's per-head norm is something else
        assert (per_head - expected).abs().max() > 1e-2


def test_olmo2_post_norm_is_applied_before_the_residual_add():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from toolkit.adapters.families.olmo2 import NormThenAdd

    torch.manual_seed(1)
    bda = NormThenAdd(config=_Config())
    hf = Olmo2RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        bda.norm.weight.copy_(torch.randn(12))
        hf.weight.copy_(bda.norm.weight)
    output, residual = torch.randn(3, 2, 12), torch.randn(3, 2, 12)
    got = bda(False, False)((output, None), residual, 0.0)
    torch.testing.assert_close(got, residual + hf(output), rtol=0, atol=1e-6)


def test_granite_residual_multiplier_scales_output_and_bias_before_the_add():
    from megatron.core.models.gpt import gpt_layer_specs

    from toolkit.adapters.build import scaled_bias_dropout_add, with_residual_multiplier

    output, bias, residual = torch.randn(3, 2, 4), torch.randn(4), torch.randn(3, 2, 4)
    got = scaled_bias_dropout_add(0.6)(False, False)((output, bias), residual, 0.0)
    torch.testing.assert_close(got, residual + (output + bias) * 0.6)
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    assert with_residual_multiplier(spec, multiplier=1.0) is spec
    scaled = with_residual_multiplier(spec, multiplier=0.6).submodules
    assert scaled.self_attn_bda is scaled.mlp_bda and scaled.self_attn_bda is not spec.submodules.self_attn_bda


def test_granite_embedding_and_logits_hooks():
    from toolkit.adapters.build import EmbeddingMultiplier, LogitsDivisor

    x = torch.randn(2, 3)
    torch.testing.assert_close(EmbeddingMultiplier(3.0)(None, (), x), x * 3.0)
    logits, bias = LogitsDivisor(2.5)(None, (), (x, None))
    assert torch.equal(logits, x / 2.5) and bias is None


def test_olmo2_tp_that_would_replicate_kv_heads_is_refused_before_ranks_start():
    from toolkit.layout import Layout
    from toolkit.layout_rules import ModelFacts, layout_problems

    olmo2, llama = (ModelFacts.from_settings(model_settings(tiny_config(t, num_key_value_heads=2)))
                    for t in ("olmo2", "llama"))
    layout = Layout(tp=4, pp=1, dp=1)
    problems = layout_problems(layout=layout, model=olmo2)
    assert [p.rule for p in problems] == ["kv_heads_vs_tp"] and "q / k norms span all heads" in problems[0].message
    assert not layout_problems(layout=layout, model=llama)  # Llama replicates each KV head on 2 ranks
    assert not layout_problems(layout=Layout(tp=2, pp=1, dp=1), model=olmo2)
