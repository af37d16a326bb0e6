"""Where a rank's ZeRO fragment of a parameter lies in the layout-free tensors: the geometry of the sharded
checkpoint state (toolkit/train/checkpoint/sharded.py).

ZeRO (stages 1-3, and DeepSpeed's bf16 optimizer) gives each data-parallel rank one contiguous range of a
parameter's flattened elements. The parameter is itself this rank's TP / PP / EP shard of a layout-free tensor
(megatron-core's `sharded_state_dict()` says where: a global offset and shape, the layers stacked on a prepended
axis), or several pieces of them (SwiGLU's fc1 holds the gate and the up projection, two layout-free tensors). A
contiguous range of a row-major box is a short list of boxes (a partial row, whole rows, a partial row, per
dimension), each contiguous in memory: so a fragment is saved as boxes of the layout-free tensors, without a
byte of communication, and a rank of any other layout reads the boxes that intersect the ones it needs.

This is what megatron-core's `fully_sharded_model_space` optimizer format described with `flattened_range`, which
megatron-core 0.16 no longer accepts in `ShardedTensor`; the boxes need no such attribute. Pure functions."""

from __future__ import annotations

import dataclasses
import math

import torch

from toolkit.errors import DsmtError


@dataclasses.dataclass(frozen=True)
class Box:
    """A block of a tensor: its offset and its shape (equal lengths)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self, within: Box | None = None) -> tuple[slice, ...]:
        """Index of this box, relative to the offset of `within` (None: absolute)."""
        base = within.offset if within is not None else (0,) * len(self.offset)
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offset, base, self.shape, strict=True))


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements [start, stop) of a row-major tensor of `shape` as boxes, in order; each box is contiguous in
    memory, so the k-th holds the next `numel` elements of the range."""
    if not 0 <= start <= stop <= math.prod(shape):
        raise DsmtError(f"flat range [{start}, {stop}) is outside a tensor of shape {tuple(shape)}")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)

    def in_row(row: int, begin: int, end: int) -> list[Box]:
        return [Box((row, *box.offset), (1, *box.shape)) for box in flat_boxes(shape[1:], begin, end)]

    if first_row == last_row:
        return in_row(first_row, first_col, last_col)
    boxes = []
    if first_col:
        boxes += in_row(first_row, first_col, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row, *(0,) * (len(shape) - 1)), (last_row - first_row, *shape[1:])))
    if last_col:
        boxes += in_row(last_row, 0, last_col)
    return boxes


def intersection(a: Box, b: Box) -> Box | None:
    """The common block of two boxes of one tensor, None when they do not meet."""
    low = tuple(max(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    high = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offset, a.shape, b.offset, b.shape, strict=True))
    if any(h <= lo for lo, h in zip(low, high)):
        return None
    return Box(low, tuple(h - lo for lo, h in zip(low, high)))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One layout-free tensor's block that a parameter holds: elements [start, start + numel) of the parameter's
    flattened data are the block `box` (global coordinates, prepended axes included) of tensor `key`."""

    key: str
    global_shape: tuple[int, ...]
    box: Box
    start: int  # in the parameter's flattened elements
    written: bool  # this rank's copy is the one saved (megatron's main replica over TP / PP; any DP rank)

    @property
    def numel(self) -> int:
        return self.box.numel

    def boxes(self, start: int, stop: int) -> list[tuple[Box, int]]:
        """The parameter's elements [start, stop) that fall in this piece, as (global box, first element)."""
        begin, end = max(start, self.start), min(stop, self.start + self.numel)
        if begin >= end:
            return []
        found, first = [], begin
        for local in flat_boxes(self.box.shape, begin - self.start, end - self.start):
            offset = tuple(o + g for o, g in zip(local.offset, self.box.offset, strict=True))
            found.append((Box(offset, local.shape), first))
            first += local.numel
        return found


def written_replica(replica_id) -> bool:
    """Whether a rank's copy is saved: megatron's replica id is (PP, TP, DP) replica indices (or one int); the DP
    index is ignored, since DP ranks hold different fragments, not copies."""
    if isinstance(replica_id, int):
        return True
    return all(index == 0 for index in tuple(replica_id)[:-1])


def param_pieces(item, *, shape: tuple[int, ...], dtype: torch.dtype) -> list[Piece]:
    """The pieces of a parameter of `shape` whose megatron sharded item is `item` (a ShardedTensor whose data is
    the parameter, or a ShardedTensorFactory built over it). A factory is built over a meta tensor: where each of
    its tensors starts in the parameter is then its storage offset, whatever the parameter's own data is (a
    ZeRO-3 parameter holds a zero-stride stand-in)."""
    if hasattr(item, "build_fn"):
        built = item.build_fn(item.key, torch.empty(shape, dtype=dtype, device="meta"), item.replica_id, None)
        parts = list(built.values()) if isinstance(built, dict) else list(built)
    else:
        if tuple(item.data.shape) != tuple(shape):
            raise DsmtError(f"{item.key}: megatron's sharded tensor has shape {tuple(item.data.shape)}, its parameter "
                            f"{tuple(shape)}; dsmt cannot place its optimizer state (a dsmt bug: report it)")
        parts = [item]
    pieces = []
    for part in parts:
        built = hasattr(item, "build_fn")  # a view of the meta tensor; else the parameter itself (or its stand-in)
        start = part.data.storage_offset() if built else 0
        if built and not part.data.is_contiguous():
            raise DsmtError(f"{part.key}: a non-contiguous view of its parameter; dsmt cannot place its optimizer "
                            "state (a dsmt bug: report it with the model family)")
        box = Box(tuple(part.global_offset), (1,) * part.prepend_axis_num + tuple(part.local_shape))
        pieces.append(Piece(key=part.key, global_shape=tuple(part.global_shape), box=box, start=start,
                            written=written_replica(part.replica_id)))
    if sum(piece.numel for piece in pieces) != math.prod(shape):
        raise DsmtError(f"{item.key}: its sharded pieces hold {sum(p.numel for p in pieces)} elements, the parameter "
                        f"{math.prod(shape)}; dsmt cannot place its optimizer state (a dsmt bug: report it)")
    return pieces
