"""Phi-3 long-context RoPE (HF `rope_type: longrope`: Phi-3-mini-128k, Phi-3.5-mini) on megatron-core's GPTModel.

What HF computes (transformers' `_compute_longrope_parameters` and `dynamic_rope_update`):
* inverse frequencies 1 / (factor_i * base^(2i/d)), with `long_factor` when the forward's length, max(position_ids) + 1,
  exceeds `original_max_position_embeddings`, else `short_factor`; chosen per forward, for the whole batch;
* cos and sin multiplied by `attention_factor` (given, else sqrt(1 + ln(f) / ln(original_max_position_embeddings)) with
  f = `factor` or max_position_embeddings / original_max_position_embeddings; 1.0 when f <= 1), on every forward.

megatron-core has neither. `LongRopeRotary` is megatron's `RotaryEmbedding` with HF's frequencies: its length
argument is max(position_ids) + 1 on every path (plain: the sequence length; packed records: toolkit/adapters/packed.py
asks for max(position_ids) + 1; THD: megatron passes the longest record), so it chooses the factors as HF does.
The magnitude: with the rotation over the whole head (partial rotary is refused), scaling cos and sin by a scales
the rotated q and k by a, i.e. the attention scores by a^2: megatron's `softmax_scale` = a^2 / sqrt(head_dim), which
local attention and Transformer Engine both take (fused RoPE included: it only sees the frequencies).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class LongRope:
    """A checkpoint's long-RoPE parameters, as HF reads them."""

    rotary_base: float
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    def inv_freq(self, *, seq_len: int, dim: int, device=None) -> torch.Tensor:
        """HF's inverse frequencies for a forward of `seq_len` positions (long factors past the original length)."""
        factors = self.long_factor if seq_len > self.original_max_position_embeddings else self.short_factor
        ext_factors = torch.tensor(factors, dtype=torch.float32, device=device)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (ext_factors * self.rotary_base**exponents)

    def softmax_scale(self, *, head_dim: int) -> float:
        """megatron's attention-score scale that equals HF's cos/sin scaled by the attention factor (full rotary)."""
        return self.attention_factor**2 * head_dim**-0.5


def longrope_from_hf(hf_config, *, params: dict, theta: float) -> tuple[LongRope | None, str | None]:
    """(LongRope, None) from the merged rope parameters of a transformers 4 or 5 config, or (None, problem)."""
    original = params.get("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None))
    short, long = params.get("short_factor"), params.get("long_factor")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if not original or short is None or long is None or len(short) != head_dim // 2 or len(long) != head_dim // 2:
        return None, (f"rope_type 'longrope' needs original_max_position_embeddings and short_factor / long_factor "
                      f"of head_dim / 2 = {head_dim // 2} numbers each; got original_max_position_embeddings="
                      f"{original}, {len(short or [])} short and {len(long or [])} long factors")
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(rotary_base=float(theta), short_factor=tuple(float(x) for x in short),
                    long_factor=tuple(float(x) for x in long), original_max_position_embeddings=int(original),
                    attention_factor=float(attention_factor)), None


def longrope_rotary(*, model, longrope: LongRope):
    """A `LongRopeRotary` for `model` (a GPTModel built with plain RoPE), on its device and CP group."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class LongRopeRotary(RotaryEmbedding):
        """megatron's RotaryEmbedding with HF's long-RoPE frequencies, chosen by the forward's length."""

        def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            device = self.inv_freq.device
            inv_freq = longrope.inv_freq(seq_len=max_seq_len + offset, dim=model.config.kv_channels, device=device)
            positions = torch.arange(max_seq_len, device=device, dtype=torch.float32) + offset
            return torch.outer(positions, inv_freq)

    check_attention_scale(model=model, expected=model.config.softmax_scale)
    inner = model.rotary_pos_emb
    rotary = LongRopeRotary(kv_channels=model.config.kv_channels, rotary_percent=1.0,
                            rotary_base=longrope.rotary_base, use_cpu_initialization=True, cp_group=inner.cp_group)
    rotary.inv_freq = inner.inv_freq  # megatron's own device placement (moved to the GPU on first use)
    return rotary


def check_attention_scale(*, model, expected: float) -> None:
    """Every attention of `model` must scale its scores by `expected` (the attention factor lives there): megatron's
    local attention and Transformer Engine's (>= 1.10; older TE drops megatron's softmax_scale) both keep it as
    `softmax_scale`. Refused by name otherwise, before any forward."""
    from toolkit.errors import DsmtError

    for name, module in model.named_modules():
        if name.endswith("self_attention.core_attention"):  # megatron's DotProductAttention or TE's
            scale = getattr(module, "softmax_scale", None)
            if scale is None or not math.isclose(scale, expected, rel_tol=1e-12):
                raise DsmtError(f"{name} ({type(module).__name__}) scales attention scores by {scale}, not the "
                                f"{expected} that Phi-3 long-RoPE's attention factor needs: this attention ignores "
                                "megatron's softmax_scale (Transformer Engine < 1.10?). Fix: Transformer Engine >= "
                                "1.10, or training.attention: local")
