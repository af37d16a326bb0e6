"""`data.mix`: the rows of several sources drawn by weight.

The mix has `N = sum(len(part))` rows. Part `i` of weight `w_i` fills `round(N * w_i / sum(w))` of them (up to
rounding): its rows in the order of `torch.randperm(len(part_i))` seeded with `seed + i`, again from the start
when it has fewer rows than its share (an upsampled part repeats whole passes; a downsampled one gives a random
subset). Which part row `j` of the mix comes from is megatron-core's blending rule (`build_blending_indices`,
the one `data.blend` uses): each row goes to the part furthest below its share so far, so every prefix of the mix
holds the parts close to their weights. Without weights (the validation side) every part's rows appear once, in
order. The training batches then draw from the mix as from any rows (toolkit/data/batches.py).
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.data.examples import count_loss_tokens
from toolkit.errors import DsmtError


class MixedRows:
    """Rows of `parts` (each with the toolkit/data/examples.py interface) drawn by `weights` (None: by length)."""

    kind = "mix"

    def __init__(self, *, parts: list, weights: list[float] | None, seed: int, names: list[str]):
        lengths = [len(part) for part in parts]
        if len({part.seq_length for part in parts}) != 1:
            raise DsmtError(f"data.mix: the sources give rows of different lengths "
                            f"{[part.seq_length for part in parts]}; they must share training.seq_length")
        empty = [name for name, length in zip(names, lengths) if length == 0]
        if empty:
            raise DsmtError(f"mix_source_empty: data.mix source(s) {', '.join(empty)} have no rows; remove them")
        self.parts, self.names = parts, names
        self.part_of_row, self.index_in_part = blend_indices(
            weights=lengths if weights is None else weights, size=sum(lengths))
        self._orders = [torch.arange(length) if weights is None
                        else torch.randperm(length, generator=torch.Generator().manual_seed(seed + i))
                        for i, length in enumerate(lengths)]

    def __len__(self) -> int:
        return len(self.part_of_row)

    @property
    def seq_length(self) -> int:
        return self.parts[0].seq_length

    def shares(self) -> list[int]:
        """Rows of the mix from each part."""
        return np.bincount(self.part_of_row, minlength=len(self.parts)).tolist()

    def rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(rows, dtype=torch.int64)
        token_ids = torch.empty(len(rows), self.seq_length + 1, dtype=torch.int64)
        loss_mask = torch.empty(len(rows), self.seq_length, dtype=torch.float32)
        position_ids = torch.empty(len(rows), self.seq_length, dtype=torch.int64)
        part_of = torch.from_numpy(self.part_of_row[rows.numpy()].astype(np.int64))
        within = torch.from_numpy(self.index_in_part[rows.numpy()].astype(np.int64))
        for part in part_of.unique().tolist():
            chosen = part_of == part
            order = self._orders[part]
            ids, mask, positions = self.parts[part].rows(order[within[chosen] % len(order)])
            token_ids[chosen], loss_mask[chosen], position_ids[chosen] = ids, mask, positions
        return token_ids, loss_mask, position_ids

    def counted_tokens(self) -> int:
        return count_loss_tokens(self)

    def describe(self) -> str:
        return f"{len(self)} mixed rows: " + ", ".join(
            f"{share} from {name}" for share, name in zip(self.shares(), self.names))


def blend_indices(*, weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(part of each row, its running index within that part) by megatron-core's blending rule."""
    from megatron.core.datasets import helpers

    normalized = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    part_of_row = np.zeros(size, dtype=np.int16)
    index_in_part = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(part_of_row, index_in_part, normalized, len(weights), size, False)
    return part_of_row, index_in_part
