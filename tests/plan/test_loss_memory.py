"""The training loss holds no full-size copy of the logits beyond megatron's own fp32 upcast (which its cross
entropy turns in place into the softmax it saves). At a 64k vocabulary per TP rank and 4k tokens each extra fp32
copy is 1 GiB on the last stage; before, loss.py made two (an upcast, and a transposed contiguous one) plus a
masked copy on the rank holding the padded rows. Measured as live tensor bytes (tests/plan/live_tensors.py's
LiveBytes) through forward and backward, on one gloo rank, against plain torch's cross entropy."""

import pytest
import torch

MICRO, SEQ, VOCAB, PADDED = 2, 512, 16000, 16384  # the last 384 rows are padding, as on the last TP rank


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_loss_peak_is_one_fp32_copy_of_the_logits_and_the_value_is_torchs(megatron_tp1, dtype):
    from live_tensors import LiveBytes

    from toolkit.adapters.vocab_mask import PaddedVocabMask
    from toolkit.train.engine.loss import masked_token_loss_sum

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(MICRO, SEQ, PADDED, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
    loss_mask = (torch.rand(MICRO, SEQ, generator=generator) > 0.25).float()
    reference = torch.nn.functional.cross_entropy(logits.detach()[..., :VOCAB].float().reshape(-1, VOCAB),
                                                  labels.reshape(-1), reduction="none")
    expected = (reference * loss_mask.reshape(-1)).sum()

    # the logits are a fresh non-leaf here, as GPTModel's output is, padded rows -inf as its output layer sets them
    model_output = logits * 1
    PaddedVocabMask(vocab_size=VOCAB, padded_vocab_size=PADDED)(None, None, (model_output, None))
    before = {t.untyped_storage().data_ptr() for t in (logits, model_output, labels, loss_mask)}
    tracker = LiveBytes(before=before)
    with tracker:
        loss = masked_token_loss_sum(model_output, labels=labels, loss_mask=loss_mask)
        loss.backward()
    rows = MICRO * SEQ * PADDED
    fp32_copy = 4 * rows if dtype != torch.float32 else 0  # megatron's upcast; fp32 logits are used in place
    gradient = rows * logits.element_size()  # the gradient reaching the logits (16-bit cast, or fp32 itself)
    slack = 64 * MICRO * SEQ * 8  # per-token scalars (max, sums, targets, masks)
    print(f"loss peak {dtype}: {tracker.peak / rows:.3f} bytes per logit beyond the logits")
    assert tracker.peak <= fp32_copy + gradient + slack, (tracker.peak / rows, "bytes per logit")
    assert torch.allclose(loss.detach(), expected, rtol=1e-5)
    assert logits.grad[..., VOCAB:].abs().max() == 0  # the padded rows learn nothing
