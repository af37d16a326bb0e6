"""Where each row of a layout-free megatron tensor comes from in the HF tensors, as data (pure functions).

Every transform kind at TP=1 only reorders whole rows (dim 0) of its HF tensors, or appends zero rows (vocab
padding): a fused QKV tensor is [q rows of group 0 | k0 | v0 | q rows of group 1 | ...], fc1 is [gate ; up].
So a conversion never needs a transform in memory: it reads each block of rows straight from one file into its
place in the other. `megatron_blocks` lists the blocks in megatron order; `hf_blocks` is the same list seen from
each HF tensor. The `transforms` module's functions are the reference these are tested against.

Rows of a 1-D tensor (a bias) are its elements. A `transposed` row (GPT-2's Conv1D) is not a row reordering;
the converters read such a tensor whole and transpose it.
"""

from __future__ import annotations

import dataclasses

from toolkit.adapters.transforms import Kind, ShapeContext


@dataclasses.dataclass(frozen=True)
class Block:
    """Megatron rows [megatron_start, megatron_start + num_rows) = rows [hf_start, hf_start + num_rows) of HF tensor
    number `hf_index` of the row (its position in `WeightMapping.hf`); `hf_index` None: zero rows (vocab padding)."""

    megatron_start: int
    hf_index: int | None
    hf_start: int
    num_rows: int


def _hf_row_ranges(kind: Kind, *, hf_rows: list[int], ctx: ShapeContext) -> list[tuple[int | None, int, int]]:
    """(HF tensor index, first row, rows) in megatron order."""
    if kind is Kind.GATE_UP:
        return [(0, 0, hf_rows[0]), (1, 0, hf_rows[1])]
    if kind is Kind.GATE_UP_INTERLEAVED:  # gate rows 0, 2, 4, ..., then up rows 1, 3, 5, ... (one row per block)
        return [(0, row, 1) for first in (0, 1) for row in range(first, hf_rows[0], 2)]
    if kind is Kind.VOCAB:
        padding = ctx.padded_vocab_size - hf_rows[0]
        return [(0, 0, hf_rows[0])] + ([(None, 0, padding)] if padding > 0 else [])
    if kind in (Kind.QKV, Kind.QKV_PACKED):
        groups, d = ctx.num_query_groups, ctx.head_dim
        q_rows = ctx.num_attention_heads // groups * d  # query rows per group
        # QKV: three HF tensors; QKV_PACKED: one tensor [all q ; all k ; all v].
        q, k, v = (0, 1, 2) if kind is Kind.QKV else (0, 0, 0)
        k_base, v_base = (0, 0) if kind is Kind.QKV else (groups * q_rows, groups * (q_rows + d))
        ranges = []
        for g in range(groups):
            ranges += [(q, g * q_rows, q_rows), (k, k_base + g * d, d), (v, v_base + g * d, d)]
        return ranges
    return [(0, 0, hf_rows[0])]  # REPLICATED, COLUMN, ROW, GATE_UP_PACKED: the HF tensor as it is


def megatron_blocks(kind: Kind, *, hf_rows: list[int], ctx: ShapeContext) -> list[Block]:
    """The layout-free megatron tensor of this kind, top to bottom, as blocks of HF rows. `hf_rows`: the number of
    rows of each HF tensor of the table row."""
    blocks, start = [], 0
    for hf_index, hf_start, num_rows in _hf_row_ranges(kind, hf_rows=hf_rows, ctx=ctx):
        blocks.append(Block(start, hf_index, hf_start, num_rows))
        start += num_rows
    return blocks


def hf_blocks(blocks: list[Block], *, hf_index: int) -> list[Block]:
    """The blocks that make HF tensor `hf_index`, in its own row order (the inverse direction)."""
    return sorted((b for b in blocks if b.hf_index == hf_index), key=lambda b: b.hf_start)


def within(blocks: list[Block], *, start: int, stop: int) -> list[Block]:
    """The parts of `blocks` inside megatron rows [start, stop), re-based so that `start` is row 0 (one stored chunk
    of a tensor, e.g. the up half of fc1, which megatron stores as its own chunk)."""
    parts = []
    for b in blocks:
        lo, hi = max(start, b.megatron_start), min(stop, b.megatron_start + b.num_rows)
        if lo < hi:
            parts.append(Block(lo - start, b.hf_index, b.hf_start + lo - b.megatron_start, hi - lo))
    return parts

