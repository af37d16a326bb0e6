"""Which examples each data-parallel rank trains on at each step, as micro-batches of tensors.

The assignment is a pure function of `(seed, step, dp_rank)`: no iterator state, so resuming at step k gives the
batches an uninterrupted run would, and every TP/PP rank of one data-parallel replica computes the same batches
by itself (the first pipeline stage reads `tokens`/`position_ids`, the last `labels`/`loss_mask`; nothing needs
broadcasting).

Sample assignment, with `G = micro_batch_size * num_microbatches * dp_size` (the global batch):
  * step `s` trains on the global sample positions `g = s*G + j`, `j = 0 .. G-1`;
  * position `g` is example `perm[e][g % N]` of epoch `e = g // N` (N examples), where `perm[e]` is
    `torch.randperm(N)` seeded with `seed + e` (the identity when `shuffle=False`); a step may straddle two epochs;
  * `j` is laid out micro-batch-major, rank-minor: `j = (m * dp_size + r) * micro_batch_size + i` is row `i` of
    micro-batch `m` on data-parallel rank `r`.
So concatenating every rank's micro-batch 0, then every rank's micro-batch 1, ... (the (micro-batch, dp) order)
gives `global_batch_for_step`, which is also what one process with `dp_size=1` and
`num_microbatches * dp_size` micro-batches trains on: the reference for loss-parity tests.
"""

from __future__ import annotations

import torch

from toolkit.errors import DsmtError

FIRST_STAGE_KEYS = ("tokens", "position_ids")  # what the embedding stage reads
LAST_STAGE_KEYS = ("labels", "loss_mask")  # what the loss stage reads


class MicroBatches:
    """The micro-batches of data-parallel rank `dp_rank` for any step; see the module docstring for the rule."""

    def __init__(self, *, examples, micro_batch_size: int, num_microbatches: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool = True):
        _check_layout(micro_batch_size=micro_batch_size, num_microbatches=num_microbatches, dp_rank=dp_rank,
                      dp_size=dp_size, num_examples=len(examples))
        self.examples = examples
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self._permutations: dict[int, torch.Tensor] = {}

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    @property
    def steps_per_epoch(self) -> float:
        return len(self.examples) / self.global_batch_size

    def global_sample_indices(self, *, step: int) -> torch.Tensor:
        """Example indices of all `G` samples of `step`, in position order `j` (int64 `[G]`)."""
        if step < 0:
            raise DsmtError(f"step={step} must be >= 0")
        num_examples = len(self.examples)
        positions = torch.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, offsets = positions // num_examples, positions % num_examples
        indices = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            chosen = epochs == epoch
            indices[chosen] = self._permutation(epoch)[offsets[chosen]]
        return indices

    def rank_sample_indices(self, *, step: int) -> torch.Tensor:
        """Example indices of this rank's samples, `[num_microbatches, micro_batch_size]`."""
        per_micro = self.global_sample_indices(step=step).view(self.num_microbatches, self.dp_size,
                                                               self.micro_batch_size)
        return per_micro[:, self.dp_rank, :]

    def batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's `num_microbatches` micro-batches for `step`: `tokens`, `labels`, `position_ids` (int64) and
        `loss_mask` (float32), each `[micro_batch_size, seq_length]`."""
        return [self._gather(rows) for rows in self.rank_sample_indices(step=step)]

    def global_batch_for_step(self, step: int) -> dict[str, torch.Tensor]:
        """All `G` samples of `step` as one batch `[G, seq_length]`, rows in position order `j`."""
        return self._gather(self.global_sample_indices(step=step))

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            if len(self._permutations) > 2:  # a step touches at most two epochs; keep the cache small
                self._permutations.pop(min(self._permutations))
            num_examples = len(self.examples)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._permutations[epoch] = torch.randperm(num_examples, generator=generator)
            else:
                self._permutations[epoch] = torch.arange(num_examples)
        return self._permutations[epoch]

    def _gather(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        ids, loss_mask, position_ids = self.examples.rows(rows)
        return {
            "tokens": ids[:, :-1].contiguous(),
            "labels": ids[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            # restart at 0 at each packed record: the model masks attention across records (toolkit/data/packing.py)
            "position_ids": position_ids,
        }


class PreferenceBatches(MicroBatches):
    """MicroBatches over the pairs of a `PreferenceExamples` (toolkit/data/preference_rows.py): the same rule
    places pair indices (`micro_batch_size` counts pairs, as TRL's per_device_train_batch_size); each micro-batch is
    `examples.pair_rows(pair_indices)`, `rows_per_pair` rows per pair plus `pair_mask` / `pair_index`."""

    def _gather(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.examples.pair_rows(rows)


def stage_inputs(batch: dict[str, torch.Tensor], *, is_first_stage: bool, is_last_stage: bool) -> dict:
    """The part of a micro-batch a pipeline stage reads; middle stages read none (activations come by p2p)."""
    keys = (FIRST_STAGE_KEYS if is_first_stage else ()) + (LAST_STAGE_KEYS if is_last_stage else ())
    return {key: batch[key] for key in keys}


def _check_layout(*, micro_batch_size: int, num_microbatches: int, dp_rank: int, dp_size: int,
                  num_examples: int) -> None:
    problems = [f"{name}={value} must be >= 1" for name, value in
                (("micro_batch_size", micro_batch_size), ("num_microbatches", num_microbatches), ("dp_size", dp_size))
                if value < 1]
    if not 0 <= dp_rank < max(dp_size, 1):
        problems.append(f"dp_rank={dp_rank} must be in 0 .. dp_size-1 = {dp_size - 1}")
    if num_examples == 0:
        problems.append("there are no examples (the dataset tokenised to nothing)")
    if problems:
        raise DsmtError("micro-batch layout is invalid: " + "; ".join(problems))
