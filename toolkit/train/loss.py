"""The training loss on megatron's vocab-parallel logits: masked token sum, padded vocabulary excluded.

The padded rows of the output layer (vocab 250 -> 256) would otherwise take part in the softmax with logit 0,
which HF's model does not have; they are set to -inf so the loss equals HF's and those rows get no gradient."""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """logits [.., vocab/tp] on this TP rank; columns at global index >= vocab_size become -inf."""
    from megatron.core import parallel_state

    per_rank = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * per_rank
    if first + per_rank <= vocab_size:
        return logits
    keep = torch.arange(first, first + per_rank, device=logits.device) < vocab_size
    return logits.masked_fill(~keep, float("-inf"))


def masked_token_loss_sum(logits: torch.Tensor, *, labels: torch.Tensor, loss_mask: torch.Tensor,
                          vocab_size: int) -> torch.Tensor:
    """SUM of the cross entropies of the tokens with loss_mask 1 (fp32). logits [b, s, vocab/tp], labels [b, s].
    The caller divides by the global batch's number of loss tokens (`toolkit/train/engine.py`)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float(), vocab_size=vocab_size)
    # megatron's cross entropy takes [s, b, v] and labels [s, b]
    per_token = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
    return (per_token.transpose(0, 1) * loss_mask.to(per_token.dtype)).sum()
