"""Tanh softcapping (Gemma 2): `x -> cap * tanh(x / cap)`, on the attention scores and on the final logits.

HF applies it to the attention scores after the scale and before the mask (`eager_attention_forward`: scores * scaling,
then / cap, tanh, * cap, then + mask), and to the logits after the LM head (`Gemma2ForCausalLM`: / cap, tanh, * cap),
so the loss sees capped logits. megatron-core has neither:

* attention: `SoftcappedDotProductAttention` is megatron's local attention with the cap applied to the scores its
  softmax receives (already scaled by `softmax_scale` in the score matmul, not yet masked). Transformer Engine's
  attention takes no softcap: a softcapped model is refused with TE's layers (here at build, and by the layout rule
  `attention_softcap_needs_local` in `dsmt check` / `train --dry-run` before any rank starts).
* logits: `LogitsSoftcap`, a forward hook on the output layer; elementwise, so exact on vocab-parallel shards.
"""

from __future__ import annotations

import functools

import torch

from toolkit.adapters.family import AdapterError


def softcap(x: torch.Tensor, *, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in x's dtype, in HF's order of operations."""
    return torch.tanh(x / cap) * cap


@functools.cache
def softcapped_attention_class():
    """megatron's DotProductAttention with HF's softcap on its scores (a class made on first use: megatron is
    imported lazily everywhere in the adapters)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SoftcappedDotProductAttention(DotProductAttention):
        """Local attention whose scaled, unmasked scores are softcapped before megatron's masked softmax."""

        def __init__(self, *args, attention_softcap: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.attention_softcap = float(attention_softcap)
            # scale_mask_softmax(scores, mask, softmax_offset): the scores come scaled and unmasked
            self.scale_mask_softmax.register_forward_pre_hook(self._cap_scores)

        def _cap_scores(self, module, args):
            scores, *rest = args
            return (softcap(scores, cap=self.attention_softcap), *rest)

    return SoftcappedDotProductAttention


def with_attention_softcap(spec, *, cap: float | None, transformer_engine: bool):
    """The layer spec with its core attention softcapped at `cap` (None: unchanged)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if cap is None:
        return spec
    if transformer_engine:
        raise AdapterError(f"attn_logit_softcapping={cap}: Transformer Engine's attention has no logit softcapping; "
                           "set training.attention: local (megatron's attention, which dsmt softcaps as HF does)")
    attention = spec.submodules.self_attention
    core = ModuleSpec(module=softcapped_attention_class(), params={"attention_softcap": cap})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=core))))


class LogitsSoftcap:
    """Forward hook on megatron's output layer (output `(logits, bias)`): the logits softcapped at `cap`."""

    def __init__(self, cap: float):
        self.cap = float(cap)

    def __call__(self, module, inputs, output):
        logits, bias = output
        return softcap(logits, cap=self.cap), bias


def add_logits_softcap(model, *, cap: float | None) -> None:
    """Softcap the logits of `model` (a GPTModel stage; only the last stage has the output layer)."""
    if cap is not None and model.post_process:
        model.output_layer.register_forward_hook(LogitsSoftcap(cap))
