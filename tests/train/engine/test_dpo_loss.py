"""DPO's loss pieces (toolkit/train/engine/preference.py) against plain torch, on one gloo rank: the sequences' log-prob
sums from vocab-parallel logits (padded vocabulary excluded, packed pairs, gradients), the three losses and their
metrics by TRL's formulas, and the script API's pair micro-batches (toolkit/train/engine/hf_pairs.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

VOCAB, PADDED = 50, 64


def packed_pair_batch(generator):
    """Two pairs: pair 0 packed in row 0 (chosen labels 1..3, rejected 6..8), pair 1 in row 1 (chosen 0..4,
    rejected 5..9 except 7)."""
    labels = torch.randint(0, VOCAB, (2, 10), generator=generator)
    loss_mask = torch.zeros(2, 10)
    sequence_index = torch.zeros(2, 10, dtype=torch.long)
    for row, (chosen, rejected) in enumerate([([1, 2, 3], [6, 7, 8]), ([0, 1, 2, 3, 4], [5, 6, 8, 9])]):
        loss_mask[row, chosen + rejected] = 1
        sequence_index[row, chosen] = 2 * row
        sequence_index[row, rejected] = 2 * row + 1
    return {"labels": labels, "loss_mask": loss_mask, "sequence_index": sequence_index, "pair_mask": torch.ones(2)}


def test_sequence_logps_are_torchs_log_softmax_sums_and_carry_the_gradient(megatron_tp1):
    from toolkit.adapters.vocab_mask import PaddedVocabMask
    from toolkit.train.engine.preference import sequence_logps

    generator = torch.Generator().manual_seed(0)
    batch = packed_pair_batch(generator)
    logits = torch.randn(2, 10, PADDED, generator=generator, requires_grad=True)
    output = logits * 1  # GPTModel's output: the padded rows -inf, as its output layer sets them
    PaddedVocabMask(vocab_size=VOCAB, padded_vocab_size=PADDED)(None, None, (output, None))
    logps, counts = sequence_logps(output, batch=batch)
    token = torch.log_softmax(logits.detach()[..., :VOCAB], dim=-1).gather(-1, batch["labels"][..., None])[..., 0]
    expected = torch.zeros(4).index_add(0, batch["sequence_index"].flatten(),
                                        (token * batch["loss_mask"]).flatten())
    assert torch.allclose(logps.detach(), expected, atol=1e-5), (logps, expected)
    assert counts.tolist() == [3, 3, 5, 4]
    (logps * torch.tensor([1.0, -1.0, 0.5, 2.0])).sum().backward()
    assert logits.grad[..., VOCAB:].abs().max() == 0  # the padded vocabulary takes no part
    assert logits.grad[0, 0].abs().max() == 0 and logits.grad[1, 7].abs().max() == 0  # uncounted labels
    assert logits.grad[0, 1].abs().max() > 0


def dpo(loss="sigmoid", beta=0.1, label_smoothing=0.0):
    return SimpleNamespace(loss=loss, beta=beta, label_smoothing=label_smoothing)


@pytest.mark.parametrize("settings, start", [(dpo(), math.log(2)), (dpo(label_smoothing=0.2), math.log(2)),
                                              (dpo("ipo", beta=0.5), 1.0), (dpo("hinge"), 1.0)],
                         ids=["sigmoid", "cdpo", "ipo", "hinge"])
def test_policy_equal_to_reference_gives_the_starting_loss(settings, start):
    """Step 1 of a run: the policy is the reference; sigmoid: ln 2 per pair, IPO: (1 / (2 beta))^2, hinge: 1."""
    from toolkit.train.engine.preference import dpo_loss_terms

    logps = torch.tensor([-3.0, -5.0, -2.5, -4.0])
    loss, metrics = dpo_loss_terms(policy=logps, reference=logps.clone(), counts=torch.tensor([3.0, 4, 2, 5]),
                                   pair_mask=torch.ones(2), dpo=settings)
    assert abs(loss.item() / 2 - start) < 1e-6
    assert metrics[:4].abs().max() == 0 and metrics[4:].tolist() == [-5.5, -9.0]


def test_losses_and_metrics_follow_trls_formulas():
    """Hand-written TRL formulas (DPOTrainer, conservative DPO for the smoothing; IPO per completion token), with a
    padding pair (pair_mask 0) that counts nothing."""
    from toolkit.train.engine.preference import dpo_loss_terms

    policy = torch.tensor([-2.0, -6.0, -4.0, -3.0, -1.0, -1.0], requires_grad=True)
    reference = torch.tensor([-3.0, -5.0, -4.5, -2.0, -7.0, -9.0])
    counts = torch.tensor([2.0, 3.0, 4.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    chosen, rejected = (policy - reference)[0::2].detach(), (policy - reference)[1::2].detach()
    beta, eps = 0.3, 0.1
    cases = {
        "sigmoid": -(1 - eps) * torch.nn.functional.logsigmoid(beta * (chosen - rejected))
        - eps * torch.nn.functional.logsigmoid(-beta * (chosen - rejected)),
        "ipo": (chosen / counts[0::2] - rejected / counts[1::2] - 1 / (2 * beta)) ** 2,
        "hinge": torch.relu(1 - beta * (chosen - rejected)),
    }
    for name, per_pair in cases.items():
        loss, metrics = dpo_loss_terms(policy=policy, reference=reference, counts=counts, pair_mask=mask,
                                       dpo=dpo(name, beta=beta, label_smoothing=eps if name == "sigmoid" else 0))
        assert abs(loss.item() - per_pair[:2].sum().item()) < 1e-6, name
    rewards_c, rewards_r = beta * chosen[:2], beta * rejected[:2]
    expected = [rewards_c.sum(), rewards_r.sum(), (rewards_c > rewards_r).float().sum(), (rewards_c - rewards_r).sum(),
                policy.detach()[0:4:2].sum(), policy.detach()[1:4:2].sum()]
    assert torch.allclose(metrics, torch.stack(expected).float(), atol=1e-6)


def test_api_pairs_are_interleaved_rows_with_their_sequence_index():
    from toolkit.train.engine import hf_batches, hf_pairs

    rules = hf_batches.BatchRules(micro_batch_size=2, seq_length=4, vocab_size=VOCAB)
    ids = torch.arange(8).view(2, 4)
    batch = {"chosen_input_ids": ids, "chosen_labels": ids.masked_fill(ids % 4 < 2, -100),
             "rejected_input_ids": ids + 10, "rejected_labels": (ids + 10).masked_fill(ids % 4 < 2, -100)}
    rows, problems = hf_batches.take_micro_batches([batch], count=1, rules=rules,
                                                   read=hf_pairs.pair_reader(reference="live"))
    assert problems == []
    (row,) = rows
    assert row["tokens"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13], [4, 5, 6, 7], [14, 15, 16, 17]]
    assert row["loss_mask"].tolist() == [[0, 1, 1, 0]] * 4  # labels 2, 3 of each row (HF-shifted)
    assert row["sequence_index"][:, 0].tolist() == [0, 1, 2, 3] and row["pair_mask"].tolist() == [1, 1]

    _, problems = hf_batches.take_micro_batches([{**batch, "ref_chosen_logps": torch.zeros(2)}], count=1,
                                                rules=rules, read=hf_pairs.pair_reader(reference="live"))
    assert len(problems) == 1 and "computes the reference log-probs itself" in problems[0]
    _, problems = hf_batches.take_micro_batches([batch], count=1, rules=rules,
                                                read=hf_pairs.pair_reader(reference="precomputed"))
    assert len(problems) == 1 and "lacks ref_chosen_logps" in problems[0]
    for bad, needle in ((torch.zeros(1), "ref_chosen_logps is (1,), expected a float tensor of micro_batch_size = 2"),
                        (torch.tensor([0.0, float("nan")]), "non-finite")):
        _, problems = hf_batches.take_micro_batches(
            [{**batch, "ref_chosen_logps": bad, "ref_rejected_logps": torch.zeros(2)}], count=1, rules=rules,
            read=hf_pairs.pair_reader(reference="precomputed"))
        assert len(problems) == 1 and needle in problems[0], problems
    unlabelled = {**batch, "rejected_labels": torch.full_like(ids, -100)}
    _, problems = hf_batches.take_micro_batches([unlabelled], count=1, rules=rules,
                                                read=hf_pairs.pair_reader(reference="live"))
    assert len(problems) == 2 and "pair 0: the rejected side has no label" in problems[0], problems
    _, problems = hf_batches.take_micro_batches([{"input_ids": ids, "labels": ids}], count=1, rules=rules,
                                                read=hf_pairs.pair_reader(reference="live"))
    assert any("lacks 'chosen_input_ids'" in p for p in problems) and any("'input_ids'" in p for p in problems)


def test_orpo_stays_finite_for_padding_pairs_and_a_certain_completion(megatron_tp1):
    """ORPO's log(1 - p) is -inf at an average log-prob of 0: a validation padding pair (no label) and a chosen
    completion predicted with certainty (cross entropy exactly 0 in fp32) must give a finite loss and gradient."""
    from toolkit.train.engine.preference import NLL_SCALE_KEY, Orpo

    generator = torch.Generator().manual_seed(1)
    batch = packed_pair_batch(generator)
    batch["pair_mask"] = torch.tensor([1.0, 0.0])  # pair 1: padding
    batch["loss_mask"][1] = 0
    batch["sequence_index"][1] = 0
    batch[NLL_SCALE_KEY] = torch.tensor(2 / 3.0, dtype=torch.float64)
    logits = torch.randn(2, 10, PADDED, generator=generator)
    logits[0, [1, 2, 3]] = -1e4  # pair 0's chosen labels certain: their cross entropy is 0.0
    logits[0, [1, 2, 3], batch["labels"][0, [1, 2, 3]]] = 1e4
    logits.requires_grad_()
    loss, metrics = Orpo(vocab_size=VOCAB, settings=SimpleNamespace(beta=0.1)).loss_terms(logits * 1, batch)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(metrics).all(), (loss, metrics)
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 7].abs().max() > 0  # the rejected side learns
