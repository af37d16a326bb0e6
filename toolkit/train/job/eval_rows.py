"""Which rows each data-parallel rank evaluates (toolkit/train/job/evaluate.py's rule), and DPO's pairs dealt
the same way for validation and for the precomputed reference (toolkit/train/job/preference_run.py)."""

from __future__ import annotations

import math

import torch

from toolkit.errors import DsmtError


def rank_rows(*, num_examples: int, dp_rank: int, dp_size: int, micro_batch_size: int,
              microbatch_multiple: int = 1) -> list[list[int | None]]:
    """This rank's micro-batches as row indices; None is a padding row (see the module docstring)."""
    if num_examples < 1:
        raise DsmtError("the validation data tokenised to no example; give more validation records")
    rows: list[int | None] = list(range(dp_rank, num_examples, dp_size))
    num_micro = math.ceil(math.ceil(num_examples / dp_size) / micro_batch_size)
    num_micro = math.ceil(num_micro / microbatch_multiple) * microbatch_multiple
    rows += [None] * (num_micro * micro_batch_size - len(rows))
    return [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


def preference_rows(examples, rows: list[int | None]) -> dict[str, torch.Tensor]:
    """The micro-batch of pairs `rows` (toolkit/data/preference.py); a padding pair (None) repeats pair 0 with
    pair_mask 0 and its labels uncounted, so it adds nothing."""
    batch = examples.pair_rows(torch.tensor([0 if row is None else row for row in rows]))
    padding = torch.tensor([row is None for row in rows])
    if padding.any():
        rows_per_pair = batch["loss_mask"].shape[0] // len(rows)
        batch["pair_mask"] = batch["pair_mask"].masked_fill(padding, 0.0)
        batch["loss_mask"] = batch["loss_mask"].masked_fill(padding.repeat_interleave(rows_per_pair)[:, None], 0.0)
    return batch
