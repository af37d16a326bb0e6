"""Norms on a sublayer's output, before its residual add (OLMo-2, Gemma 2 / 3), where megatron-core's layer has
none: a module for the `self_attn_bda` / `mlp_bda` slots of megatron's TransformerLayer, the norm computed in fp32
as HF computes it (weight applied before the cast back), the weight scaling by (1 + w) where the config's norms are
zero-centred (Gemma) and by w otherwise (OLMo-2)."""

from __future__ import annotations

import torch


def fp32_rms_norm(x: torch.Tensor, *, weight: torch.Tensor, eps: float, sum_of_squares=None, width: int) -> torch.Tensor:
    """HF's Olmo2RMSNorm / Gemma2RMSNorm over the last dim of `x` (flattened), the mean of squares over `width`
    elements: fp32, weight applied before the cast back. `sum_of_squares(s)` completes a partial sum (TP
    all-reduce)."""
    flat = x.to(torch.float32)
    squares = flat.pow(2).sum(-1, keepdim=True)
    if sum_of_squares is not None:
        squares = sum_of_squares(squares)
    return (weight * (flat * torch.rsqrt(squares / width + eps))).to(x.dtype)


class PostNorm(torch.nn.Module):
    """An RMSNorm over the hidden size on a sublayer's output. Weight marked `sequence_parallel` (each TP rank
    normalises its sequence slice under sequence parallelism); zero-centred (scales by 1 + w, initialised to 0) when
    the config's norms are (`layernorm_zero_centered_gamma`, Gemma)."""

    def __init__(self, config, hidden_size: int, eps: float):
        super().__init__()
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        initial = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(initial(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Gemma2RMSNorm: norm(x.float()) * (1.0 + w.float()); Olmo2RMSNorm: w * norm(x.float())
        weight = 1.0 + self.weight.float() if self.zero_centered else self.weight
        return fp32_rms_norm(x, weight=weight, eps=self.eps, width=x.shape[-1])


class NormThenAdd(torch.nn.Module):
    """A `*_bda` slot of megatron's TransformerLayer: normalise the sublayer's output (its bias added first), then
    megatron's bias-dropout-add onto the residual. A module so the norm belongs to the layer (`self_attn_bda.norm`)."""

    def __init__(self, *, config):
        super().__init__()
        self.norm = PostNorm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

        add = get_bias_dropout_add(training, fused)

        def norm_then_add(output_with_bias, residual, dropout_prob):
            output, bias = output_with_bias
            output = output if bias is None else output + bias
            return add((self.norm(output), None), residual, dropout_prob)

        return norm_then_add
