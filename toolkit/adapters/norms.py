"""The torch norms of dsmt's local (non Transformer Engine) layers: `TorchNorm` (what the layer specs of build.py
and the encoder of encoder.py name), with Gemma's zero-centred (1 + w) variants."""

from __future__ import annotations

import torch

from toolkit.adapters.family import AdapterError


class TorchNorm:
    """The local layers' norm: torch RMSNorm / LayerNorm, parameters marked `sequence_parallel` as Transformer
    Engine's and apex's norms mark theirs.

    Under sequence parallelism each TP rank normalises its own slice of the sequence, so a norm weight's gradient
    is partial on each rank and must be summed over the TP group; the mark is how megatron and dsmt's engine find
    those parameters. megatron's `WrappedTorchNorm` builds the same torch modules but refuses sequence parallelism.
    A class, not a function: megatron's `build_module` returns functions uncalled."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        plain = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        centred = {"RMSNorm": ZeroCenteredRMSNorm, "LayerNorm": ZeroCenteredLayerNorm}
        norms = centred if config.layernorm_zero_centered_gamma else plain
        if config.normalization not in norms:
            raise AdapterError(f"normalization={config.normalization} has no torch norm in dsmt's local layers; "
                               f"supported: {', '.join(norms)}")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm scaled by (1 + weight), weight stored zero-centred (Gemma's norm; megatron's
    `layernorm_zero_centered_gamma`, which Transformer Engine's norms implement the same way). In fp32 with one cast
    back, as HF's GemmaRMSNorm: (1 + w) rounded to bf16 would be off by up to 2^-9 per channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, 1 + self.weight.float(), self.eps)
        return normed.to(x.dtype)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm scaled by (1 + weight) (megatron's `layernorm_zero_centered_gamma`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, 1 + self.weight, self.bias, self.eps)
