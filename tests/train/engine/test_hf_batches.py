"""HF-convention micro-batches (toolkit/train/engine/hf_batches.py): the shift into dsmt's token rows, every check, and
`api.initialize` refusing a bad spec before any process group exists. One process, no ranks."""

from __future__ import annotations

import pytest
import torch

from toolkit.train.engine import hf_batches

RULES = hf_batches.BatchRules(micro_batch_size=2, seq_length=5, vocab_size=50)


def batch(**changes):
    values = {"input_ids": torch.tensor([[3, 4, 5, 6, 7], [8, 9, 1, 0, 0]]),
              "labels": torch.tensor([[3, 4, 5, 6, 7], [8, 9, 1, -100, -100]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    values.update(changes)
    return {key: value for key, value in values.items() if value is not None}


def test_rows_carry_the_labels_shifted_as_hf_shifts_them():
    rows = hf_batches.to_token_rows(batch())
    assert rows["tokens"].tolist() == [[3, 4, 5, 6, 7], [8, 9, 1, 0, 0]]
    # logits at t predict HF labels[t + 1]; nothing is predicted from the last position or into padding
    assert rows["labels"].tolist() == [[4, 5, 6, 7, 0], [9, 1, 0, 0, 0]]
    assert rows["loss_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2


def test_rows_stay_on_the_device_of_the_batch():
    """A script may pass CUDA tensors: nothing may be created on the CPU beside them ('meta' stands in here)."""
    on_device = {key: value.to("meta") for key, value in batch(position_ids=None).items()}
    rows = hf_batches.to_token_rows(on_device)
    assert {value.device.type for value in rows.values()} == {"meta"}
    del on_device["attention_mask"]
    assert hf_batches.to_token_rows(on_device)["position_ids"].device.type == "meta"


def test_packed_records_keep_their_position_ids():
    packed = batch(attention_mask=None, position_ids=torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]),
                   labels=torch.tensor([[3, 4, -100, 6, 7], [8, 9, 1, 0, 0]]))
    assert hf_batches.micro_batch_problems(packed, index=0, rules=RULES) == []
    rows = hf_batches.to_token_rows(packed)
    assert rows["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert rows["loss_mask"][0].tolist() == [1, 0, 1, 1, 0]  # no label from one record into the next


@pytest.mark.parametrize("changes, expected", [
    ({"labels": None}, "micro-batch 0 lacks 'labels'"),
    ({"token_type_ids": torch.zeros(2, 5, dtype=torch.long)}, "keys ['token_type_ids'] dsmt does not read"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, "input_ids has shape [2, 4], the run takes"),
    ({"labels": torch.zeros(2, 5)}, "labels has dtype torch.float32"),
    ({"input_ids": torch.tensor([[3, 4, 5, 6, 50], [8, 9, 1, 0, 0]])}, "input_ids holds 50 outside the vocabulary"),
    ({"labels": torch.tensor([[3, 4, -1, 6, 7], [8, 9, 1, -100, -100]])}, "labels holds -1 outside"),
    ({"attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}, "padding (0) before tokens"),
    ({"attention_mask": torch.tensor([[1, 1, 1, 1, 2], [1, 1, 1, 0, 0]])}, "attention_mask holds 2; it takes 1 (token) and 0"),
    ({"labels": torch.tensor([[3, 4, 5, 6, 7], [8, 9, 1, 0, -100]])}, "labels are not -100 where attention_mask"),
    ({"position_ids": torch.tensor([[0, 1, 2, 3, -4], [0, 1, 2, 3, 4]])}, "position_ids_form: micro-batch 0"),
    ({"position_ids": torch.tensor([[0, 1, 2, 3, 4], [512, 513, 514, 515, 516]])}, "row 1 is [512, 513"),
    ({"position_ids": torch.tensor([[0, 1, 3, 4, 5], [0, 1, 2, 3, 4]])}, "restart at 0 where a packed record"),
    ({"attention_mask": torch.ones(2, 5, dtype=torch.long).to("meta")}, "micro_batch_device"),
])
def test_each_fault_is_named(changes, expected):
    problems = hf_batches.micro_batch_problems(batch(**changes), index=0, rules=RULES)
    assert any(expected in problem for problem in problems), problems


def test_not_a_mapping_and_a_short_iterator_are_named():
    assert "is a list, not a mapping" in hf_batches.micro_batch_problems([1, 2], index=0, rules=RULES)[0]
    rows, problems = hf_batches.take_micro_batches(iter([batch()]), count=2, rules=RULES)
    assert len(rows) == 1 and "ended after 1; one optimizer step takes 2" in problems[0]
    _, problems = hf_batches.take_micro_batches(42, count=2, rules=RULES)
    assert "not an iterable" in problems[0]


def test_packed_records_are_refused_on_a_layout_that_cannot_take_them():
    refusing = hf_batches.BatchRules(micro_batch_size=2, seq_length=5, vocab_size=50,
                                     packing_refusal="parallel.cp=2: packed records are not cut")
    packed = batch(attention_mask=None, position_ids=torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]))
    problems = hf_batches.micro_batch_problems(packed, index=0, rules=refusing)
    assert problems and problems[0].startswith("packed_layout: ") and "parallel.cp=2" in problems[0]
    assert hf_batches.micro_batch_problems(batch(), index=0, rules=refusing) == []  # one record per row is fine


def test_a_list_of_the_wrong_length_and_an_unreadable_batch_are_problems_not_raises():
    _, problems = hf_batches.take_micro_batches([batch()] * 3, count=2, rules=RULES)
    assert "a list of 3 micro-batches; one optimizer step takes 2" in problems[0]

    class Broken(dict):
        def get(self, key, default=None):
            raise RuntimeError("lazy column failed")

    _, problems = hf_batches.take_micro_batches([Broken(batch())], count=1, rules=RULES)
    assert "could not be read: RuntimeError: lazy column failed" in problems[0]


def test_the_same_problem_on_many_ranks_is_one_line():
    reports = [["micro_batch_shape: x"]] * 12 + [None, ["labels_vocab: y"]]
    text = hf_batches._merged(reports)
    assert text.splitlines() == ["  ranks 0, 1, 2, 3, 4, 5, 6, 7, ... (12 ranks): micro_batch_shape: x",
                                 "  rank 13: labels_vocab: y"]


def test_the_fingerprint_tells_different_micro_batches_apart():
    rows = [hf_batches.to_token_rows(batch())]
    swapped = batch()
    swapped["input_ids"] = swapped["input_ids"].flip(0)
    assert hf_batches.fingerprint(rows) == hf_batches.fingerprint([hf_batches.to_token_rows(batch())])
    assert hf_batches.fingerprint(rows) != hf_batches.fingerprint([hf_batches.to_token_rows(swapped)])
    assert hf_batches.fingerprint(rows * 2) != hf_batches.fingerprint(rows)


def test_initialize_refuses_a_bad_spec_before_any_process_group(tiny_llama):
    import torch.distributed as dist

    from toolkit import api
    from toolkit.errors import SpecError

    spec = {"model": {"path": str(tiny_llama)}, "parallel": {"tp": 3},
            "cluster": {"nodes": 1, "gpus_per_node": 3, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"}}
    with pytest.raises(SpecError) as raised:
        api.initialize(spec)
    assert "heads" in str(raised.value) and "data_source" not in str(raised.value)
    assert not dist.is_initialized()


def test_a_padding_row_counts_nothing():
    rows = hf_batches.padding_rows(RULES)
    assert rows["loss_mask"].sum() == 0 and rows["tokens"].shape == (2, 5)
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
