"""Phi-3 long-context RoPE (HF `rope_type: longrope`: Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) on megatron-core's
GPTModel.

What HF computes (transformers' `_compute_longrope_parameters`, `dynamic_rope_update`, phi3 `apply_rotary_pos_emb`):
* inverse frequencies 1 / (factor_i * base^(2i/r)) over the rotated width r = int(head_dim * partial_rotary_factor)
  (Phi-4-mini: 96 of 128), with `long_factor` when the forward's length, max(position_ids) + 1, exceeds
  `original_max_position_embeddings`, else `short_factor`; chosen per forward, for the whole batch;
* cos and sin multiplied by `attention_factor` (given, else sqrt(1 + ln(f) / ln(original_max_position_embeddings)) with
  f = `factor` or max_position_embeddings / original_max_position_embeddings; 1.0 when f <= 1), on every forward;
* the first r dims of each q / k head rotated (rotate_half over those r dims) by the scaled cos / sin, the other
  head_dim - r dims passed through unscaled.

megatron-core has neither the frequencies nor the factor. `LongRopeRotary` is megatron's `RotaryEmbedding` with HF's
frequencies: its length argument is max(position_ids) + 1 on every path (plain: the sequence length; packed records:
toolkit/adapters/packed.py asks for the longest record, read on the host; THD: megatron passes it too), so it chooses the
factors as HF does. Partial rotation is megatron's own: GPTModel's `rotary_percent` makes frequencies for the first
r dims and its RoPE rotates those (rotate_half, non-interleaved) and passes the rest, as HF.

The magnitude a (attention factor), two exact placements:
* the whole head rotates (Phi-3, Phi-3.5): q and k are scaled by a entirely, each score by a^2: megatron's
  `softmax_scale` = a^2 / sqrt(head_dim), which local attention and Transformer Engine both take (fused RoPE
  included: it only sees the frequencies);
* part of each head rotates (Phi-4-mini): only the rotated part of q.k carries a^2, so NO score scale equals it.
  megatron's SelfAttention has HF's very step: `apply_rotary_pos_emb(..., mscale=...)` multiplies cos and sin by
  mscale in fp32, casts them to the activations' dtype and rotates the first r dims only. Its mscale is
  `_yarn_get_concentration_factor_from_config(config)`, from the YaRN attributes a GPT config may carry (megatron's
  training arguments set them for YaRN); `scale_rotation` sets them so that it is exactly a (checked at build).
  Transformer Engine's fused RoPE kernels take no mscale (megatron falls back to its unfused RoPE for BSHD, silently
  not for packed THD records), so such a model is built with the unfused RoPE (`unfused_rope_fields`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from toolkit.errors import DsmtError


@dataclasses.dataclass(frozen=True)
class LongRope:
    """A checkpoint's long-RoPE parameters, as HF reads them."""

    rotary_base: float
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    head_dim: int
    rotary_dim: int  # the rotated width of each head: int(head_dim * partial_rotary_factor)

    @property
    def rotates_whole_head(self) -> bool:
        return self.rotary_dim == self.head_dim

    def inv_freq(self, *, seq_len: int, device=None) -> torch.Tensor:
        """HF's inverse frequencies for a forward of `seq_len` positions (long factors past the original length)."""
        factors = self.long_factor if seq_len > self.original_max_position_embeddings else self.short_factor
        ext_factors = torch.tensor(factors, dtype=torch.float32, device=device)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        return 1.0 / (ext_factors * self.rotary_base**exponents)

    def softmax_scale(self) -> float | None:
        """megatron's attention-score scale that equals HF's cos/sin scaled by the attention factor: a^2 / sqrt(d) when
        the whole head rotates; None (megatron's own 1 / sqrt(d)) when only part of it does (`rotation_scale`)."""
        return self.attention_factor**2 * self.head_dim**-0.5 if self.rotates_whole_head else None

    @property
    def rotation_scale(self) -> float:
        """The factor megatron's RoPE must put on cos and sin itself: a when only part of each head rotates, else 1."""
        return 1.0 if self.rotates_whole_head else self.attention_factor


def longrope_from_hf(hf_config, *, params: dict, theta: float, rotary_dim: int) -> tuple[LongRope | None, str | None]:
    """(LongRope, None) from the merged rope parameters of a transformers 4 or 5 config, or (None, problem).
    `rotary_dim`: the rotated width of each head (the whole head_dim without partial rotary)."""
    original = params.get("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None))
    short, long = params.get("short_factor"), params.get("long_factor")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    half = rotary_dim // 2
    if not original or short is None or long is None or len(short) != half or len(long) != half:
        return None, (f"rope_type 'longrope' needs original_max_position_embeddings and short_factor / long_factor "
                      f"of rotary_dim / 2 = {half} numbers each (rotary_dim {rotary_dim} of head_dim {head_dim}); "
                      f"got original_max_position_embeddings={original}, {len(short or [])} short and "
                      f"{len(long or [])} long factors")
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(rotary_base=float(theta), short_factor=tuple(float(x) for x in short),
                    long_factor=tuple(float(x) for x in long), original_max_position_embeddings=int(original),
                    attention_factor=float(attention_factor), head_dim=int(head_dim), rotary_dim=int(rotary_dim)), None


def _rotation_scale(rope_scaling: dict | None) -> float:
    longrope = (rope_scaling or {}).get("longrope")
    return 1.0 if longrope is None else longrope.rotation_scale


def unfused_rope_fields(rope_scaling: dict | None) -> dict:
    """TransformerConfig fusion overrides for a model whose RoPE scales cos / sin (`rotation_scale` != 1): Transformer
    Engine's fused RoPE takes no mscale (megatron 0.16 drops it for packed THD records), so the unfused RoPE."""
    return {"apply_rope_fusion": False} if _rotation_scale(rope_scaling) != 1.0 else {}


def scale_rotation(config, *, rope_scaling: dict | None) -> None:
    """Make megatron's SelfAttention multiply cos and sin by the model's `rotation_scale` a (see the module docstring):
    the YaRN attributes on `config` with concentration factor (0.1 * m * ln(s) + 1) / (0.1 * m_all * ln(s) + 1) = a
    exactly: s = e (ln = 1.0 exactly), m_all = 0 (denominator 1.0), m the double nearest (a - 1) / 0.1 for which
    0.1 * m + 1.0 rounds to a. Nothing is set where a = 1."""
    factor = _rotation_scale(rope_scaling)
    if factor == 1.0:
        return
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale

    mscale = (factor - 1.0) / 0.1
    for _ in range(64):  # a few ulps at most: 0.1 * m is finer-grained than a's ulp near 1
        got = _yarn_get_mscale(math.e, mscale)
        if got == factor:
            break
        mscale = math.nextafter(mscale, math.inf if got < factor else -math.inf)
    config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim = math.e, mscale, 0.0
    check_rotation_scale(config=config, expected=factor)


def check_rotation_scale(*, config, expected: float) -> None:
    """megatron's attention must put exactly `expected` on cos / sin (its YaRN concentration factor)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)

    got = _yarn_get_concentration_factor_from_config(config)
    if got != expected:
        raise DsmtError(f"megatron's RoPE scales cos / sin by {got!r}, not the long-RoPE attention factor {expected!r} "
                        "that Phi-3 partial rotary needs: the TransformerConfig was not built by "
                        "toolkit.adapters.build.transformer_config (which calls longrope.scale_rotation)")


def longrope_rotary(*, model, longrope: LongRope):
    """A `LongRopeRotary` for `model` (a GPTModel built with plain RoPE over the rotated width), on its device and CP
    group; checks that the attention factor is where `longrope` puts it (score scale or cos / sin)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class LongRopeRotary(RotaryEmbedding):
        """megatron's RotaryEmbedding with HF's long-RoPE frequencies, chosen by the forward's length."""

        def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            device = self.inv_freq.device
            inv_freq = longrope.inv_freq(seq_len=max_seq_len + offset, device=device)
            positions = torch.arange(max_seq_len, device=device, dtype=torch.float32) + offset
            return torch.outer(positions, inv_freq)

    if longrope.rotates_whole_head:
        check_attention_scale(model=model, expected=model.config.softmax_scale)
    else:
        check_rotation_scale(config=model.config, expected=longrope.rotation_scale)
    inner = model.rotary_pos_emb
    if inner.inv_freq.numel() * 2 != longrope.rotary_dim:
        raise DsmtError(f"the model's RoPE rotates {inner.inv_freq.numel() * 2} dims of each head, long-RoPE "
                        f"{longrope.rotary_dim}: GPTModel was built without the checkpoint's rotary_percent")
    rotary = LongRopeRotary(kv_channels=model.config.kv_channels, rotary_percent=model.rotary_percent,
                            rotary_base=longrope.rotary_base, use_cpu_initialization=True, cp_group=inner.cp_group)
    rotary.inv_freq = inner.inv_freq  # megatron's own device placement (moved to the GPU on first use)
    return rotary


def check_attention_scale(*, model, expected: float) -> None:
    """Every attention of `model` must scale its scores by `expected` (the attention factor lives there): megatron's
    local attention and Transformer Engine's (>= 1.10; older TE drops megatron's softmax_scale) both keep it as
    `softmax_scale`. Refused by name otherwise, before any forward."""
    for name, module in model.named_modules():
        if name.endswith("self_attention.core_attention"):  # megatron's DotProductAttention or TE's
            scale = getattr(module, "softmax_scale", None)
            if scale is None or not math.isclose(scale, expected, rel_tol=1e-12):
                raise DsmtError(f"{name} ({type(module).__name__}) scales attention scores by {scale}, not the "
                                f"{expected} that Phi-3 long-RoPE's attention factor needs: this attention ignores "
                                "megatron's softmax_scale (Transformer Engine < 1.10?). Fix: Transformer Engine >= "
                                "1.10, or training.attention: local")
