"""The training loss on megatron's vocab-parallel logits: masked token sum, padded vocabulary excluded.

The padded rows of the output layer (vocab 250 -> 256) would otherwise take part in the softmax with logit 0,
which HF's model does not have; the model's output layer sets them to -inf (toolkit/adapters/vocab_mask.py), so the
loss equals HF's and those rows get no gradient. Not here: the logits the loss gets may be a view (one row), and
an in-place write to a view drops the hooks on it, DeepSpeed's backward prologue among them."""

from __future__ import annotations

import torch


def masked_token_loss_sum(logits: torch.Tensor, *, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """SUM of the cross entropies of the tokens with loss_mask 1 (fp32). logits [b, s, vocab/tp], labels [b, s].
    The caller divides by the global batch's number of loss tokens (`toolkit/train/engine/hybrid.py`).

    Memory: one full-size tensor beyond the logits, at most. megatron's vocab_parallel_cross_entropy takes any
    leading dimensions ([b, s] here, no transposed copy), upcasts 16-bit logits to fp32 itself and turns that copy
    in place into the softmax it saves for backward; fp32 logits are used in place. So the logits are consumed: fp32
    logits become the softmax (as megatron's own loss consumes GPTModel's output). Inside the cross entropy's own
    autograd function that in-place use keeps the output's hooks (tests/train/engine/test_train_zero3_te.py)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token = vocab_parallel_cross_entropy(logits, labels)
    return (per_token * loss_mask.to(per_token.dtype)).sum()
