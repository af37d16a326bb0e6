"""Phi-3 long-RoPE (toolkit/adapters/longrope.py) and partial rotary (Phi-4-mini) against transformers: the
frequencies and attention factor of `_compute_longrope_parameters` (whole and partial heads), megatron's rotary output
against `Phi3RotaryEmbedding`'s cos / sin on both sides of `original_max_position_embeddings`, megatron's RoPE with
the factor on cos / sin against phi3's `apply_rotary_pos_emb` bit for bit, Phi-4-mini-shaped logits in one process
(and that a score scale there would be wrong), the short branch end to end (test_parity_multiproc.py runs the long one
at every layout), and the refusals."""

import math

import pytest
import torch

from tests.adapters.conftest import PHI3_LONGROPE, PHI4_MINI
from tests.adapters.one_process import max_logit_gap
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
    assert torch.equal(longrope.inv_freq(seq_len=seq_len), expected_freq)
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
    host.config = type("Config", (), {"kv_channels": 8, "softmax_scale": longrope.softmax_scale()})
    host.rotary_percent = 1.0

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
    assert "rotary_percent" not in settings.rope_scaling  # the whole head rotates
    assert "softmax_scale" not in model_settings(tiny_config("phi3")).transformer_fields


def test_other_families_and_unreadable_configs_are_refused_by_name():
    llama = tiny_config("llama", rope_parameters={**PHI3_LONGROPE["rope_parameters"],
                                                  "original_max_position_embeddings": ORIGINAL})
    assert "phi3 only" in rope_settings(llama)[2]
    from types import SimpleNamespace

    from toolkit.adapters.longrope import longrope_from_hf

    # transformers' Phi3Config refuses this itself; a config it did not validate is refused here too
    raw = SimpleNamespace(hidden_size=64, num_attention_heads=8, max_position_embeddings=128, head_dim=None)
    params = {**PHI3_LONGROPE["rope_parameters"], "short_factor": [1.0, 2.0], "original_max_position_embeddings": 16}
    longrope, problem = longrope_from_hf(raw, params=params, theta=10000.0, rotary_dim=8)
    assert longrope is None and "2 short and 4 long factors" in problem
    odd = tiny_config("phi3", partial_rotary_factor=0.375)  # 3 of 8 dims: no rotate_half pairs
    assert "partial_rotary_factor=0.375: rotates 3 of head_dim 8 dims" in rope_settings(odd)[2]


@pytest.mark.parametrize("seq_len", [ORIGINAL, ORIGINAL + 1])
def test_partial_rotary_reads_transformers_width_frequencies_and_factor(seq_len):
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    from toolkit.adapters.hf_config import model_settings

    config = tiny_config("phi3", **PHI4_MINI)
    expected_freq, expected_factor = _compute_longrope_parameters(config, seq_len=seq_len)
    _, scaling, problem = rope_settings(config)
    longrope = scaling["longrope"]
    assert problem is None and scaling["rotary_percent"] == 0.75 and longrope.rotary_dim == 6
    assert torch.equal(longrope.inv_freq(seq_len=seq_len), expected_freq)
    assert longrope.attention_factor == expected_factor
    # the factor goes on cos / sin, not on the scores; megatron's default score scale stays
    assert longrope.softmax_scale() is None and longrope.rotation_scale == expected_factor
    assert "softmax_scale" not in model_settings(config).transformer_fields
    plain = rope_settings(tiny_config("phi3", partial_rotary_factor=0.5))
    assert plain == (10000.0, {"rotary_percent": 0.5}, None)  # default RoPE over 4 of 8 dims: GPTModel's own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megatron_rope_with_the_factor_on_cos_sin_equals_phi3_bit_for_bit(dtype):
    """megatron's SelfAttention step (`apply_rotary_pos_emb` with the config's YaRN mscale, which `scale_rotation`
    makes the attention factor) against phi3's `apply_rotary_pos_emb` with `Phi3RotaryEmbedding`'s cos / sin: the
    first 6 dims of each head rotated by the scaled cos / sin, the last 2 passed through, equal bit for bit."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf_apply

    from toolkit.adapters.longrope import scale_rotation

    config = tiny_config("phi3", **PHI4_MINI)
    scaling = rope_settings(config)[1]
    megatron_config = type("Config", (), {"apply_rope_fusion": False, "rotary_interleaved": False,
                                          "multi_latent_attention": False})()
    scale_rotation(megatron_config, rope_scaling=scaling)
    mscale = _yarn_get_concentration_factor_from_config(megatron_config)
    assert mscale == scaling["longrope"].attention_factor
    q = torch.randn(2, 8, 40, 8, generator=torch.Generator().manual_seed(0)).to(dtype)  # [b, heads, s, head_dim]
    cos, sin = Phi3RotaryEmbedding(config)(q, torch.arange(40)[None])
    expected, _ = hf_apply(q, q, cos, sin)
    freqs = torch.outer(torch.arange(40, dtype=torch.float32), scaling["longrope"].inv_freq(seq_len=40))
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # megatron's RotaryEmbedding layout [s, 1, 1, 6]
    got = apply_rotary_pos_emb(q.permute(2, 0, 1, 3), emb, config=megatron_config, mscale=mscale,
                               cp_group=object())  # read for packed THD records only
    assert torch.equal(got.permute(1, 2, 0, 3), expected)
    assert torch.equal(got[..., 6:].permute(1, 2, 0, 3), q[..., 6:])  # the passed dims: untouched, unscaled


def test_phi4_mini_shaped_logits_equal_transformers_and_a_score_scale_would_not(tmp_path, monkeypatch):
    """One process, fp32: the Phi-4-mini-shaped tiny model (partial rotary, long factors at 32 positions, tied
    embeddings) gives HF's logits; the same model with the attention factor as a score scale (the whole-head rule)
    does not, so the comparison sees where the factor goes."""
    from toolkit.adapters import longrope as longrope_module
    from toolkit.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "phi4_mini", model_type="phi3", seed=31, **PHI4_MINI)
    exact = _megatron_vs_hf_max_diff(path)
    assert exact < 1e-5, exact

    def as_score_scale(config, *, rope_scaling):  # the factor a^2 on every score, none on cos / sin
        config.softmax_scale = rope_scaling["longrope"].attention_factor ** 2 * 8**-0.5

    monkeypatch.setattr(longrope_module, "scale_rotation", as_score_scale)
    monkeypatch.setattr(longrope_module, "check_rotation_scale", lambda **kwargs: None)
    wrong = _megatron_vs_hf_max_diff(path)
    assert wrong > 1e-3, wrong


def _megatron_vs_hf_max_diff(path) -> float:
    return max_logit_gap(path, tokens=torch.randint(3, 250, (2, 2 * ORIGINAL), generator=torch.Generator().manual_seed(0)))


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


def test_phi4_mini_builds_in_the_dry_run():
    """`dsmt check --deep` / `train --dry-run` build the model on the meta device from a config they set fields on:
    the long-RoPE factor on cos / sin survives (a dataclasses.replace used to drop it, refusing every Phi-4-mini)."""
    from toolkit.adapters.hf_config import model_settings
    from toolkit.check.dryrun import stage_parameter_counts
    from toolkit.parallel.groups import Layout

    counts = stage_parameter_counts(settings=model_settings(tiny_config("phi3", **PHI4_MINI)), layout=Layout(),
                                    params_dtype=torch.float32)
    assert counts["first"] > 0
