"""Synthetic, deterministic inputs for a model without a megatron-core adapter (`data.synthetic: true`): smoke
tests and benchmarks. Real data goes through `toolkit.data.tasks` (`TaskBatches`)."""

from __future__ import annotations

import torch

from toolkit.data.tasks import task_of
from toolkit.errors import DsmtError

DEFAULT_IMAGE_SIZE = 32  # ResNet configs carry no image size (the net is size-agnostic); small keeps CPU tests fast
MASKED_FRACTION = 0.15  # BERT's masking rate


class PlainBatches:
    """Synthetic, deterministic training batches for a plain HF model.

    Sample assignment follows toolkit/data/batches.py: with `G = micro_batch_size * num_microbatches * dp_size`,
    step `s` trains on global positions `g = s*G + j`, and `j = (m * dp_size + r) * micro_batch_size + i` is row
    `i` of micro-batch `m` on rank `r`; so ranks take disjoint slices and `global_batch_for_step` (the
    (micro-batch, rank) order) is what one process with `dp_size=1` and `num_microbatches * dp_size` micro-batches
    trains on. Sample `g` is drawn from a generator seeded by `(seed, g)` alone: a pure function, and learnable:
      image_classification     `pixel_values` [C, H, W] = a fixed per-label pattern + noise; `labels` a class id.
                               H = W = config.image_size when the config has one, else 32.
      masked_lm                `input_ids` an arithmetic sequence mod (vocab_size - 1) with random start and
                               stride; ~15% of positions (at least one) replaced by the mask id (config's
                               mask_token_id, else vocab_size - 1, which the sequences never use); `labels` the
                               original ids there, -100 elsewhere; `attention_mask` ones.
      sequence_classification  such a sequence with stride `label + 1`; `labels` the class id (a float target
                               when num_labels == 1, i.e. regression); `attention_mask` ones.
      causal_lm                such a sequence; `labels` = `input_ids` (HF shifts them itself).
    """

    def __init__(self, *, model_config, micro_batch_size: int, num_microbatches: int, dp_rank: int, dp_size: int,
                 seed: int, seq_length: int):
        problems = [f"{name}={value} must be >= 1" for name, value in
                    (("micro_batch_size", micro_batch_size), ("num_microbatches", num_microbatches),
                     ("dp_size", dp_size), ("seq_length", seq_length)) if value < 1]
        if not 0 <= dp_rank < max(dp_size, 1):
            problems.append(f"dp_rank={dp_rank} must be in 0 .. dp_size-1 = {dp_size - 1}")
        if problems:
            raise DsmtError("micro-batch layout is invalid: " + "; ".join(problems))
        self.kind = task_of(model_config)
        self.config = model_config
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.seq_length = seq_length
        self.num_labels = int(getattr(model_config, "num_labels", 2))
        if self.kind == "image_classification":
            self.image_size = int(getattr(model_config, "image_size", None) or DEFAULT_IMAGE_SIZE)
            self.num_channels = int(getattr(model_config, "num_channels", 3))
            patterns = torch.Generator().manual_seed(seed)
            self._patterns = torch.randn(self.num_labels, self.num_channels, self.image_size, self.image_size,
                                         generator=patterns)
        else:
            self.vocab_size = int(model_config.vocab_size)
            self.mask_id = getattr(model_config, "mask_token_id", None)
            if self.mask_id is None:
                self.mask_id = self.vocab_size - 1

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    def batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's `num_microbatches` micro-batches for `step`, as keyword inputs of the model."""
        first = self._first_position(step)
        batches = []
        for micro in range(self.num_microbatches):
            row0 = first + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
            batches.append(self._collate(range(row0, row0 + self.micro_batch_size)))
        return batches

    def global_batch_for_step(self, step: int) -> dict[str, torch.Tensor]:
        """All `G` samples of `step` as one batch, rows in position order `j`."""
        first = self._first_position(step)
        return self._collate(range(first, first + self.global_batch_size))

    def _first_position(self, step: int) -> int:
        if step < 0:
            raise DsmtError(f"step={step} must be >= 0")
        return step * self.global_batch_size

    def _collate(self, positions) -> dict[str, torch.Tensor]:
        samples = [self._sample(g) for g in positions]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def _sample(self, position: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        if self.kind == "image_classification":
            label = int(torch.randint(self.num_labels, (), generator=generator))
            noise = torch.randn(self._patterns.shape[1:], generator=generator)
            return {"pixel_values": self._patterns[label] + 0.5 * noise, "labels": torch.tensor(label)}
        if self.kind == "sequence_classification":
            label = int(torch.randint(self.num_labels, (), generator=generator))
            ids = self._sequence(generator, stride=label + 1)
            target = torch.tensor(float(label)) if self.num_labels == 1 else torch.tensor(label)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": target}
        ids = self._sequence(generator, stride=int(torch.randint(1, 4, (), generator=generator)))
        if self.kind == "causal_lm":
            return {"input_ids": ids, "labels": ids.clone()}
        masked = torch.rand(self.seq_length, generator=generator) < MASKED_FRACTION
        masked[int(torch.randint(self.seq_length, (), generator=generator))] = True  # never an all -100 row
        return {"input_ids": torch.where(masked, self.mask_id, ids), "attention_mask": torch.ones_like(ids),
                "labels": torch.where(masked, ids, -100)}

    def _sequence(self, generator: torch.Generator, *, stride: int) -> torch.Tensor:
        start = int(torch.randint(self.vocab_size - 1, (), generator=generator))
        return (start + stride * torch.arange(self.seq_length)) % (self.vocab_size - 1)
