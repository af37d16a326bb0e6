"""Sliding-window attention: which layers of an HF config attend to a window, in megatron-core's terms.

HF's sliding window of size w lets query position i see key positions j with i - w < j <= i (transformers'
`sliding_window_overlay`: `kv_idx > q_idx - sliding_window`), i.e. w - 1 tokens to the left and itself. megatron-core
and Transformer Engine take `window_size = (left, right)` with the same meaning of left: (w - 1, 0). Which layers are
windowed is megatron's `window_attn_skip_freq` as a list, one entry per layer, 1 = windowed (megatron's
`is_layer_window_attention`, global 1-based layer numbers), read from HF's `layer_types` where the config has it
(transformers 5: Gemma 2/3, Qwen2), else every layer when `sliding_window` is set (Mistral, Phi-3, StarCoder2)."""

from __future__ import annotations

import dataclasses

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """The HF window size and, per layer (0-based), whether that layer uses it."""

    size: int
    windowed_layers: tuple[bool, ...]

    @property
    def any(self) -> bool:
        return any(self.windowed_layers)

    def covers(self, seq_length: int) -> bool:
        """Full causal attention equals the window's when no sequence is longer than the window."""
        return seq_length <= self.size

    def transformer_fields(self) -> dict:
        """megatron TransformerConfig fields: `window_size` and the per-layer list `window_attn_skip_freq`."""
        if not self.any:
            return {}
        return {"window_size": (self.size - 1, 0), "window_attn_skip_freq": [int(w) for w in self.windowed_layers]}


def sliding_window(hf_config) -> SlidingWindow | None:
    """The checkpoint's sliding window, or None when no layer uses one."""
    size = getattr(hf_config, "sliding_window", None)
    if not size:
        return None
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        windowed = tuple(kind == SLIDING for kind in layer_types)
    elif getattr(hf_config, "use_sliding_window", True) is False:
        windowed = (False,) * num_layers
    else:
        windowed = (True,) * num_layers
    window = SlidingWindow(size=int(size), windowed_layers=windowed)
    return window if window.any else None


def window_fields(hf_config) -> dict:
    """A family's `read_config` part for its sliding window: megatron's window fields, or nothing."""
    window = sliding_window(hf_config)
    return window.transformer_fields() if window is not None else {}


def keep_explicit_masks_windowed(model) -> None:
    """megatron's local attention applies a layer's window by building its own sliding-window causal mask, and
    then drops any mask it was given (fusions/fused_softmax.py, `forward_torch_softmax`): packed records would
    see each other. On every windowed softmax of `model` (local layers only; Transformer Engine's attention takes
    the window and the THD records itself) a given mask is combined with the window instead."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    for module in model.modules():
        if isinstance(module, FusedScaleMaskSoftmax) and module.window_size is not None:
            module.forward_torch_softmax = _windowed(module)


def _windowed(softmax):
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    window, plain = softmax.window_size, softmax.forward_torch_softmax

    def forward_torch_softmax(scores, mask, softmax_offset=None):
        if mask is None:  # megatron's own sliding-window causal mask
            return plain(scores, mask, softmax_offset)
        outside = get_sliding_window_causal_mask(scores.shape[-2], scores.shape[-1], window).to(mask.device)
        softmax.window_size = None  # True = masked in both: the given mask, or outside the window
        try:
            return plain(scores, mask | outside, softmax_offset)
        finally:
            softmax.window_size = window

    return forward_torch_softmax
