"""Phi-3 long-RoPE (toolkit/adapters/longrope.py) against transformers: the frequencies and attention factor of
`_compute_longrope_parameters`, megatron's rotary output against `Phi3RotaryEmbedding`'s cos / sin on both sides of
`original_max_position_embeddings`, the short branch end to end (test_parity_multiproc.py runs the long one at every
layout), and the refusals."""

import math

import pytest
import torch

from tests.adapters.conftest import PHI3_LONGROPE
from toolkit.adapters.hf_config import rope_settings
from toolkit.models.tiny import tiny_config

ORIGINAL = PHI3_LONGROPE["original_max_position_embeddings"]


def longrope_config(**rope_overrides):
    rope = {**PHI3_LONGROPE["rope_parameters"], **rope_overrides}
    return tiny_config("phi3", original_max_position_embeddings=ORIGINAL, rope_parameters=rope)


@pytest.mark.parametrize("rope_overrides", [{}, {"attention_factor": 1.25}, {"factor": 3.0}])
@pytest.mark.parametrize("seq_len", [1, ORIGINAL, ORIGINAL + 1, 128])
def test_frequencies_and_attention_factor_equal_transformers(rope_overrides, seq_len):
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    config = longrope_config(**rope_overrides)
    expected_freq, expected_factor = _compute_longrope_parameters(config, seq_len=seq_len)
    _, scaling, problem = rope_settings(config)
    longrope = scaling["longrope"]
    assert problem is None and longrope.attention_factor == expected_factor
    assert torch.equal(longrope.inv_freq(seq_len=seq_len, dim=8), expected_freq)
    if not rope_overrides:  # the default factor: sqrt(1 + ln(128 / 16) / ln(16))
        assert expected_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(16)))


@pytest.mark.parametrize("seq_len", [5, ORIGINAL, ORIGINAL + 1, 40])
def test_megatron_rotary_gives_transformers_cos_and_sin(seq_len):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from toolkit.adapters.longrope import longrope_rotary
    from toolkit.backend import cpu

    cpu.install()
    config = longrope_config()
    longrope = rope_settings(config)[1]["longrope"]

    host = torch.nn.Module()  # what longrope_rotary reads from a GPTModel (no attention layers here)
    host.rotary_pos_emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    host.config = type("Config", (), {"kv_channels": 8, "softmax_scale": longrope.softmax_scale(head_dim=8)})

    rotary = longrope_rotary(model=host, longrope=longrope)
    freqs = rotary(seq_len)[:, 0, 0, :]  # [s, d]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), torch.arange(seq_len)[None])
    scale = longrope.attention_factor
    assert torch.allclose(torch.cos(freqs) * scale, cos[0], rtol=0, atol=1e-6)
    assert torch.allclose(torch.sin(freqs) * scale, sin[0], rtol=0, atol=1e-6)
    other_len = 40 if seq_len <= ORIGINAL else 5  # the other branch's frequencies differ: the choice is visible
    assert not torch.allclose(rotary(other_len)[1, 0, 0, :], freqs[1])


def test_softmax_scale_carries_the_attention_factor_and_plain_phi3_keeps_the_default():
    from toolkit.adapters.hf_config import model_settings

    settings = model_settings(longrope_config(attention_factor=1.25))
    assert settings.transformer_fields["softmax_scale"] == pytest.approx(1.25**2 / math.sqrt(8))
    assert "softmax_scale" not in model_settings(tiny_config("phi3")).transformer_fields


def test_partial_rotary_and_other_families_are_refused_by_name():
    from toolkit.adapters.families.phi3 import check_phi3_config

    partial = tiny_config("phi3", original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                          rope_parameters={**PHI3_LONGROPE["rope_parameters"], "short_factor": [1.0] * 3,
                                           "long_factor": [2.0] * 3, "partial_rotary_factor": 0.75})
    assert any("partial_rotary_factor=0.75" in p for p in check_phi3_config(partial))
    llama = tiny_config("llama", rope_parameters={**PHI3_LONGROPE["rope_parameters"],
                                                  "original_max_position_embeddings": ORIGINAL})
    assert "phi3 only" in rope_settings(llama)[2]
    from types import SimpleNamespace

    from toolkit.adapters.longrope import longrope_from_hf

    # transformers' Phi3Config refuses this itself; a config it did not validate is refused here too
    raw = SimpleNamespace(hidden_size=64, num_attention_heads=8, max_position_embeddings=128, head_dim=None)
    params = {**PHI3_LONGROPE["rope_parameters"], "short_factor": [1.0, 2.0], "original_max_position_embeddings": 16}
    longrope, problem = longrope_from_hf(raw, params=params, theta=10000.0)
    assert longrope is None and "2 short and 4 long factors" in problem


@pytest.mark.multiproc
def test_short_branch_logits_equal_transformers(tiny_checkpoints):
    from toolkit.verify.run import run_verify_many

    result, = run_verify_many(checkpoints=[tiny_checkpoints["phi3_longrope"]], tp=1, pp=1, seq_len=ORIGINAL - 4,
                              tolerance=1e-4)
    assert result["passed"], result


def test_an_attention_that_drops_the_score_scale_is_refused_by_name():
    from toolkit.adapters.longrope import check_attention_scale
    from toolkit.errors import DsmtError

    class Attention(torch.nn.Module):  # stands for TE < 1.10, which keeps its own 1/sqrt(d)
        softmax_scale = 8**-0.5

    model, node = torch.nn.Module(), None
    for part in ("decoder", "layers", "0", "self_attention"):
        node, parent = torch.nn.Module(), node or model
        parent.add_module(part, node)
    node.add_module("core_attention", Attention())
    check_attention_scale(model=model, expected=8**-0.5)
    with pytest.raises(DsmtError, match="decoder.layers.0.self_attention.core_attention \\(Attention\\) scales "
                                        "attention scores by 0.35.*Transformer Engine >= 1.10"):
        check_attention_scale(model=model, expected=1.25**2 * 8**-0.5)
