"""Validation data (toolkit/data/validation.py): the held-out split, the validation file's checks, the cache keys
of the two sides; the evaluation's row layout and schedule (toolkit/train/job/evaluate.py); metrics truncation."""

import json

import pytest
import torch

from toolkit.data import validation
from toolkit.data.cache import prepare_cache, open_cache
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec
from toolkit.train.job.evaluate import eval_steps, rank_rows

TEXTS = [f"story number {i} is about a cat." for i in range(20)]


def test_split_is_seeded_disjoint_and_in_record_order():
    split = validation.split_records(num_records=20, fraction=0.25, seed=7)
    expected_held_out = sorted(torch.randperm(20, generator=torch.Generator().manual_seed(7))[:5].tolist())
    assert split.validation == expected_held_out
    assert split.train == sorted(set(range(20)) - set(expected_held_out))
    assert validation.split_records(num_records=20, fraction=0.25, seed=7) == split
    assert validation.split_records(num_records=20, fraction=0.25, seed=8) != split
    assert "15 for training, 5 held out" in split.describe(fraction=0.25, seed=7)


@pytest.mark.parametrize("fraction, side", [(0.01, "no validation record"), (0.99, "no training record")])
def test_split_leaving_a_side_empty_is_a_named_error(fraction, side):
    with pytest.raises(validation.ValidationFractionError, match=side) as caught:
        validation.split_records(num_records=20, fraction=fraction, seed=7)
    assert caught.value.rule == "validation_fraction_empty" and "20 records" in str(caught.value)


def test_held_out_records_are_excluded_from_training(write_jsonl, cache_dir):
    data = DataSpec(path=write_jsonl([{"text": t} for t in TEXTS]), validation_fraction=0.25)
    train = validation.part_records(data=data, part="train", seed=7, cache_dir=cache_dir)["text"][:]
    held = validation.part_records(data=data, part="validation", seed=7, cache_dir=cache_dir)["text"][:]
    assert len(train) == 15 and len(held) == 5 and not set(train) & set(held)
    assert sorted(train + held) == sorted(TEXTS)
    assert train == [t for t in TEXTS if t in train]  # record order kept


def test_missing_validation_file_names_it(write_jsonl, tmp_path):
    data = DataSpec(path=write_jsonl([{"text": t} for t in TEXTS]), validation_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(validation.ValidationPathMissingError, match=r"nope.jsonl' does not exist.*field\(s\) text"):
        validation.part_records(data=data, part="validation", seed=7)


def test_validation_file_with_other_fields_names_both(write_jsonl, cache_dir):
    train_path = write_jsonl([{"text": t} for t in TEXTS])
    other = write_jsonl([{"prompt": "a", "completion": "b"}], name="val.jsonl")
    data = DataSpec(path=train_path, validation_path=other)
    with pytest.raises(validation.ValidationFieldsError) as caught:
        validation.part_records(data=data, part="validation", seed=7, cache_dir=cache_dir)
    message = str(caught.value)
    assert "val.jsonl" in message and "prompt, completion" in message and "reads text" in message
    assert isinstance(caught.value, DsmtError) and caught.value.exit_code == 2


def test_train_and_validation_get_their_own_cache_entries(write_jsonl, tiny_checkpoint, tmp_path, cache_dir):
    data = DataSpec(path=write_jsonl([{"text": t} for t in TEXTS]), validation_fraction=0.25, packing=False)
    common = dict(data=data, model_path=str(tiny_checkpoint), seq_length=16, vocab_size=250,
                  cache_root=tmp_path / "cache", datasets_cache_dir=cache_dir, split_seed=7)
    train_dir = prepare_cache(part="train", **common)
    validation_dir = prepare_cache(part="validation", **common)
    assert train_dir != validation_dir
    assert prepare_cache(part="validation", **{**common, "split_seed": 8}) != validation_dir
    rows = len(open_cache(train_dir)), len(open_cache(validation_dir))
    assert rows[0] > rows[1] > 0


@pytest.mark.parametrize("dp_size, micro", [(1, 2), (2, 1), (2, 2), (3, 2)])
def test_rank_rows_round_robin_with_equal_micro_batch_counts(dp_size, micro):
    layouts = [rank_rows(num_examples=7, dp_rank=r, dp_size=dp_size, micro_batch_size=micro) for r in range(dp_size)]
    assert len({len(rows) for rows in layouts}) == 1  # every rank runs the same number of micro-batches
    assert all(len(batch) == micro for rows in layouts for batch in rows)
    real = sorted(row for rows in layouts for batch in rows for row in batch if row is not None)
    assert real == list(range(7))  # every example exactly once
    assert [row for batch in layouts[0] for row in batch if row is not None] == list(range(0, 7, dp_size))


def test_eval_schedule():
    assert eval_steps(eval_interval=2, start=0, total=5) == [0, 2, 4, 5]
    assert eval_steps(eval_interval=None, start=0, total=5) == [0, 5]
    assert eval_steps(eval_interval=2, start=2, total=5) == [4, 5]  # resumed after step 2: it has step 2 already
    assert eval_steps(eval_interval=2, start=5, total=5) == []


def test_resumed_metrics_keep_the_step0_validation(tmp_path):
    from toolkit.train.job.report import RunLog

    lines = [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 5.1}, {"step": 2, "loss": 5.0},
             {"step": 2, "val_loss": 4.9}, {"step": 3, "loss": 4.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = RunLog.__new__(RunLog)
    log.output_dir = tmp_path
    log._truncate_metrics(after_step=2)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:4]
    log._truncate_metrics(after_step=0)  # a fresh start keeps nothing
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_validation_file_does_not_change_the_training_key(write_jsonl, tokenizer):
    from toolkit.data.cache import cache_key

    data = DataSpec(path=write_jsonl([{"text": t} for t in TEXTS]))
    first = data.model_copy(update={"validation_path": write_jsonl([{"text": "a."}], name="v1.jsonl")})
    second = data.model_copy(update={"validation_path": write_jsonl([{"text": "b."}], name="v2.jsonl")})
    key = lambda spec, part: cache_key(data=spec, tokenizer=tokenizer, seq_length=16, part=part, split_seed=7)[0]
    assert key(first, "train") == key(second, "train") == key(data, "train")
    assert key(first, "validation") != key(second, "validation")
