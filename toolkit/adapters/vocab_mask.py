"""The padded vocabulary (vocab 250 -> 256 for the vocab-parallel layers) kept out of the softmax: its logits -inf."""

from __future__ import annotations

import torch


def mask_padded_vocab(output_layer: torch.nn.Module, *, settings) -> None:
    """Hook `PaddedVocabMask` on a model's output layer when its vocabulary is padded (vocab 250 -> 256). Register it
    after every other hook on the output layer: one that maps the logits after it (Gemma 2's softcap turns -inf
    into -cap) would bring the padded columns back into the softmax."""
    if settings.padded_vocab_size > settings.vocab_size:
        output_layer.register_forward_hook(PaddedVocabMask(vocab_size=settings.vocab_size,
                                                           padded_vocab_size=settings.padded_vocab_size))


class PaddedVocabMask:
    """Forward hook on megatron's output layer (output `(logits, bias)`, logits [s, b, vocab/tp] or gathered): the
    padded vocabulary's columns set to -inf, so the softmax and the loss equal HF's (which has no such rows) and
    those rows of the output weight get no gradient. In place, outside autograd: no copy of the logits (a copy only
    where they are a view already, as megatron's TP-1 gather returns them).

    Here and not on GPTModel's output: for one row (micro_batch_size 1, every packed THD micro-batch) GPTModel
    returns a VIEW of these logits ([s, 1, v] transposed), and an in-place write to a view re-bases its autograd
    history, which drops the hooks registered on it: DeepSpeed's backward prologue (its gradient-accumulation
    boundary, which ZeRO-1/2 reduce by) hangs on the tensor `engine.forward` returns and would never run."""

    def __init__(self, *, vocab_size: int, padded_vocab_size: int):
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size

    def __call__(self, module, inputs, output) -> tuple | None:
        from megatron.core import parallel_state

        logits = output[0]
        width = logits.shape[-1]
        gathered = width == self.padded_vocab_size  # parallel_output=False (or TP 1): the whole vocabulary
        first = 0 if gathered else parallel_state.get_tensor_model_parallel_rank() * width
        if first + width <= self.vocab_size:
            return
        keep = torch.arange(first, first + width, device=logits.device) < self.vocab_size
        if logits._is_view():  # megatron's gather at TP 1 returns its input as is: autograd refuses a write there
            return logits.masked_fill(~keep, float("-inf")), *output[1:]
        with torch.no_grad():
            logits.masked_fill_(~keep, float("-inf"))
        return None
