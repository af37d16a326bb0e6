"""MicroBatches: the sample-assignment rule, DP sharding, determinism and resume."""

import pytest
import torch

from toolkit.data import FIRST_STAGE_KEYS, LAST_STAGE_KEYS, MicroBatches, stage_inputs, synthetic_examples
from toolkit.data.tokenize import Examples
from toolkit.errors import DsmtError


def _numbered(num_examples: int, seq_length: int = 4) -> Examples:
    """Example k holds ids k*100 + 0..seq_length, so a row names the example it came from."""
    ids = torch.arange(num_examples)[:, None] * 100 + torch.arange(seq_length + 1)
    return Examples(token_ids=ids, loss_mask=torch.ones(num_examples, seq_length), kind="synthetic")


def _source(batch) -> list[int]:
    return (batch["tokens"][:, 0] // 100).tolist()


def _ranks(examples, *, dp_size=2, num_microbatches=3, micro_batch_size=2, seed=7, shuffle=True):
    return [MicroBatches(examples=examples, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                         dp_rank=r, dp_size=dp_size, seed=seed, shuffle=shuffle) for r in range(dp_size)]


def test_batch_fields_shapes_and_alignment():
    batches = _ranks(_numbered(20))[0].batches_for_step(0)
    assert len(batches) == 3
    for batch in batches:
        assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (2, 4) for k in
                                                                 ("tokens", "labels", "loss_mask", "position_ids")}
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])  # labels are tokens shifted by one
        assert batch["loss_mask"].dtype == torch.float32 and batch["tokens"].dtype == torch.int64
        assert batch["position_ids"].tolist() == [[0, 1, 2, 3]] * 2


def test_dp_shards_are_disjoint_and_union_is_the_global_batch():
    ranks = _ranks(_numbered(50), dp_size=2)
    for step in range(4):
        per_rank = [r.batches_for_step(step) for r in ranks]
        seen = [i for batches in per_rank for b in batches for i in _source(b)]
        assert len(seen) == len(set(seen)) == 12  # disjoint: 50 examples, one global batch of 12 per step
        # (micro-batch, dp) order reproduces global_batch_for_step, row for row and field for field
        ordered = [per_rank[r][m] for m in range(3) for r in range(2)]
        reference = ranks[0].global_batch_for_step(step)
        for key in reference:
            assert torch.equal(torch.cat([b[key] for b in ordered]), reference[key])


def test_single_process_reference_matches_data_parallel_run():
    examples = _numbered(30)
    dp_ranks = _ranks(examples, dp_size=2, num_microbatches=3)
    single = MicroBatches(examples=examples, micro_batch_size=2, num_microbatches=6, dp_rank=0, dp_size=1, seed=7,
                          shuffle=True)
    for step in range(5):
        mine = single.batches_for_step(step)
        theirs = [dp_ranks[r].batches_for_step(step)[m] for m in range(3) for r in range(2)]
        assert [_source(b) for b in mine] == [_source(b) for b in theirs]


def test_epochs_visit_every_example_once_in_a_seeded_order():
    examples = _numbered(12)
    ranks = _ranks(examples, dp_size=2, num_microbatches=1, micro_batch_size=2)  # G = 4: 3 steps per epoch
    epoch0 = ranks[0].global_sample_indices(step=0).tolist() + ranks[0].global_sample_indices(step=1).tolist() \
        + ranks[0].global_sample_indices(step=2).tolist()
    assert sorted(epoch0) == list(range(12)) and epoch0 != list(range(12))
    assert epoch0 == torch.randperm(12, generator=torch.Generator().manual_seed(7)).tolist()
    epoch1 = torch.cat([ranks[0].global_sample_indices(step=s) for s in (3, 4, 5)]).tolist()
    assert epoch1 == torch.randperm(12, generator=torch.Generator().manual_seed(8)).tolist()
    assert ranks[0].steps_per_epoch == 3


def test_step_straddling_an_epoch_boundary():
    mb = _ranks(_numbered(10), dp_size=1, num_microbatches=1, micro_batch_size=4)[0]
    indices = mb.global_sample_indices(step=2).tolist()  # positions 8..11: two from epoch 0, two from epoch 1
    assert indices[:2] == torch.randperm(10, generator=torch.Generator().manual_seed(7))[8:].tolist()
    assert indices[2:] == torch.randperm(10, generator=torch.Generator().manual_seed(8))[:2].tolist()


def test_no_shuffle_keeps_record_order():
    mb = _ranks(_numbered(10), dp_size=1, num_microbatches=2, micro_batch_size=3, shuffle=False)[0]
    assert [_source(b) for b in mb.batches_for_step(0)] == [[0, 1, 2], [3, 4, 5]]
    assert [_source(b) for b in mb.batches_for_step(1)] == [[6, 7, 8], [9, 0, 1]]


def test_deterministic_and_resume_gives_the_uninterrupted_batches():
    examples = synthetic_examples(vocab_size=250, seq_length=8, num_examples=37, seed=3)
    run = _ranks(examples, dp_size=2)[1]
    uninterrupted = [run.batches_for_step(s) for s in range(10)]
    resumed = _ranks(examples, dp_size=2)[1]  # a fresh process asked for step 6 first
    for step in (6, 9, 7, 8):
        for a, b in zip(uninterrupted[step], resumed.batches_for_step(step)):
            assert all(torch.equal(a[k], b[k]) for k in a)
    other_seed = _ranks(examples, dp_size=2, seed=8)[1].batches_for_step(0)
    assert not torch.equal(other_seed[0]["tokens"], uninterrupted[0][0]["tokens"])


def test_stage_inputs_split_first_and_last_stage_keys():
    batch = _ranks(_numbered(8), dp_size=1, num_microbatches=1)[0].batches_for_step(0)[0]
    assert tuple(stage_inputs(batch, is_first_stage=True, is_last_stage=False)) == FIRST_STAGE_KEYS
    assert tuple(stage_inputs(batch, is_first_stage=False, is_last_stage=True)) == LAST_STAGE_KEYS
    assert stage_inputs(batch, is_first_stage=False, is_last_stage=False) == {}
    assert set(stage_inputs(batch, is_first_stage=True, is_last_stage=True)) == set(batch)


def test_bad_layout_lists_every_problem():
    with pytest.raises(DsmtError, match=r"micro_batch_size=0 must be >= 1; dp_rank=2 must be in 0 \.\. dp_size-1 = 1"):
        MicroBatches(examples=_numbered(4), micro_batch_size=0, num_microbatches=1, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(DsmtError, match="step=-1"):
        _ranks(_numbered(4))[0].batches_for_step(-1)


def test_synthetic_examples_are_seeded_and_learnable():
    a = synthetic_examples(vocab_size=50, seq_length=16, num_examples=8, seed=1)
    b = synthetic_examples(vocab_size=50, seq_length=16, num_examples=8, seed=1)
    assert torch.equal(a.token_ids, b.token_ids) and a.token_ids.shape == (8, 17)
    assert int(a.token_ids.max()) < 50 and a.loss_mask.sum() == 8 * 16
    steps = (a.token_ids[:, 1:] - a.token_ids[:, :-1]) % 50  # each row has one constant stride in {1, 2, 3}
    assert all(len(set(row.tolist())) == 1 and row[0] in (1, 2, 3) for row in steps)
    with pytest.raises(DsmtError, match="vocab_size=2 must be >= 4"):
        synthetic_examples(vocab_size=2, seq_length=4, num_examples=1, seed=0)
