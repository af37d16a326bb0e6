"""The training loss on megatron's vocab-parallel logits: masked token sum, padded vocabulary excluded.

The padded rows of the output layer (vocab 250 -> 256) would otherwise take part in the softmax with logit 0,
which HF's model does not have; they are set to -inf so the loss equals HF's and those rows get no gradient."""

from __future__ import annotations

import torch


def mask_padded_vocab_(logits: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """logits [.., vocab/tp] on this TP rank; columns at global index >= vocab_size set to -inf, in place and
    outside autograd: no copy of the logits in forward (the op that made them does not save them) nor of their
    gradient in backward (the cross entropy's gradient there is already 0: softmax exp(-inf) = 0, no label)."""
    from megatron.core import parallel_state

    per_rank = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * per_rank
    if first + per_rank <= vocab_size:
        return logits
    keep = torch.arange(first, first + per_rank, device=logits.device) < vocab_size
    with torch.no_grad():
        logits.masked_fill_(~keep, float("-inf"))
    return logits


def masked_token_loss_sum(logits: torch.Tensor, *, labels: torch.Tensor, loss_mask: torch.Tensor,
                          vocab_size: int) -> torch.Tensor:
    """SUM of the cross entropies of the tokens with loss_mask 1 (fp32). logits [b, s, vocab/tp], labels [b, s].
    The caller divides by the global batch's number of loss tokens (`toolkit/train/engine/hybrid.py`).

    Memory: one full-size tensor beyond the logits, at most. megatron's vocab_parallel_cross_entropy takes any
    leading dimensions ([b, s] here, no transposed copy), upcasts 16-bit logits to fp32 itself and turns that copy
    in place into the softmax it saves for backward; fp32 logits are used in place. So the logits are consumed: the
    padded columns become -inf, and fp32 logits the softmax (as megatron's own loss consumes GPTModel's output)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token = vocab_parallel_cross_entropy(mask_padded_vocab_(logits, vocab_size=vocab_size), labels)
    return (per_token * loss_mask.to(per_token.dtype)).sum()
