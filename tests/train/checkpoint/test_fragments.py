"""The geometry of the sharded checkpoint state (toolkit/train/checkpoint/fragments.py, sharded.py) and who hashes
what at resume (integrity.readers_share), checked against brute force on small tensors."""

import itertools
import math
import random

import pytest
import torch

from toolkit.errors import DsmtError
from toolkit.train.checkpoint.fragments import Box, Piece, flat_boxes, intersection, param_pieces
from toolkit.train.checkpoint.integrity import readers_share
from toolkit.train.checkpoint.sharded import SavedBoxes, index_record

SHAPES = [(7,), (3, 5), (2, 3, 4), (1, 6, 1, 5), (4, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_flat_boxes_are_the_range_in_order_each_contiguous(shape):
    numel = math.prod(shape)
    flat = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = flat_boxes(shape, start, stop)
        values = [flat[box.slices()].reshape(-1) for box in boxes]
        got = torch.cat(values) if values else torch.empty(0, dtype=torch.long)
        assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop, boxes)  # in order, contiguous
        assert len(boxes) <= 2 * len(shape) - 1 or len(shape) == 0


def test_flat_boxes_refuse_a_range_outside_the_tensor():
    with pytest.raises(DsmtError, match=r"flat range \[3, 9\) is outside a tensor of shape \(2, 4\)"):
        flat_boxes((2, 4), 3, 9)


def test_intersection_matches_a_mask():
    rng = random.Random(0)
    for _ in range(300):
        boxes = []
        for _ in range(2):
            offset = tuple(rng.randrange(6) for _ in range(3))
            boxes.append(Box(offset, tuple(rng.randrange(1, 7 - o) for o in offset)))
        masks = []
        for box in boxes:
            mask = torch.zeros(6, 6, 6, dtype=torch.bool)
            mask[box.slices()] = True
            masks.append(mask)
        common = intersection(*boxes)
        both = masks[0] & masks[1]
        if common is None:
            assert not both.any()
        else:
            expected = torch.zeros_like(both)
            expected[common.slices()] = True
            assert torch.equal(expected, both)


def test_a_piece_places_a_parameter_range_in_the_global_tensor():
    """A stacked layer's TP shard: layer 2 of 4, columns 4..8 of 8; a fragment of its elements lands there."""
    piece = Piece(key="w", global_shape=(4, 3, 8), box=Box((2, 0, 4), (1, 3, 4)), start=0, written=True)
    whole = torch.full((4, 3, 8), -1)
    param = torch.arange(12).view(3, 4)
    for box, first in piece.boxes(5, 11):
        whole[box.slices()] = param.view(-1)[first:first + box.numel].view(box.shape)
    placed = whole[2, :, 4:]
    assert torch.equal(placed.reshape(-1)[5:11], torch.arange(5, 11)) and (whole >= 0).sum() == 6


def test_a_swiglu_factory_splits_into_two_pieces_by_storage_offset():
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    param = torch.zeros(6, 3)  # [gate; up] of 3 rows each on this TP rank (tp rank 1 of 2)
    item = ShardedTensor.from_rank_offsets("fc1", param, (0, 1, 2), replica_id=(0, 0, 3))
    factory = apply_swiglu_sharded_factory(item, ())
    pieces = param_pieces(factory, shape=(6, 3), dtype=torch.float32)
    # the layout-free fc1 is [gate of every TP rank; up of every TP rank]: this rank's gate at rows 3..6, its up
    # (elements 9.. of the parameter) at rows 9..12
    assert [(p.key, p.start, p.box, p.global_shape, p.written) for p in pieces] == [
        ("fc1", 0, Box((3, 0), (3, 3)), (12, 3), True), ("fc1", 9, Box((9, 0), (3, 3)), (12, 3), True)]


def test_a_tp_replica_is_not_written_but_a_dp_rank_is():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    norm = torch.zeros(4)
    for replica_id, written in [((0, 0, 3), True), ((0, 1, 0), False), ((1, 0, 0), False)]:
        item = ShardedTensor.from_rank_offsets("norm", norm, replica_id=replica_id)
        assert [p.written for p in param_pieces(item, shape=(4,), dtype=torch.float32)] == [written]


def test_saved_boxes_find_exactly_the_boxes_that_meet():
    rng = random.Random(1)
    entries = []
    for row in range(0, 40, 4):  # a 40 x 6 tensor written as boxes of 4 rows, some split in two
        if rng.random() < 0.5:
            entries.append({"file": "a", "offset": [row, 0], "shape": [4, 6]})
        else:
            entries += [{"file": "b", "offset": [row, 0], "shape": [2, 6]},
                        {"file": "c", "offset": [row + 2, 0], "shape": [2, 6]}]
    saved = SavedBoxes(entries)
    for _ in range(200):
        low = rng.randrange(40)
        wanted = Box((low, rng.randrange(6)), (rng.randrange(1, 41 - low), 1))
        found = {(box.offset, file) for box, file, _ in saved.meeting(wanted)}
        brute = {(tuple(e["offset"]), e["file"]) for e in entries
                 if intersection(wanted, Box(tuple(e["offset"]), tuple(e["shape"]))) is not None}
        assert found == brute


def test_the_index_refuses_a_tensor_covered_twice_or_not_at_all():
    one = [{"key": "w", "offset": [0], "shape": [4]}]
    assert index_record([("r0", one, {"w": [4]})])["boxes"] == [{"file": "r0", **one[0]}]
    with pytest.raises(DsmtError, match=r"(?s)cover each tensor exactly once.*w: 8 of 4 elements"):
        index_record([("r0", one, {"w": [4]}), ("r1", one, {"w": [4]})])
    with pytest.raises(DsmtError, match=r"w: 4 of 6 elements"):
        index_record([("r0", one, {"w": [6]})])


def test_each_file_read_is_hashed_once_by_one_of_its_readers():
    entries = {name: {"size": size} for name, size in [("a", 100), ("b", 60), ("c", 50), ("d", 10), ("x", 999)]}
    reads = [{"a": 1, "d": 1}, {"a": 1, "b": 1}, {"b": 1, "c": 1, "gone": 1}]
    shares = [readers_share(reads, entries=entries, rank=rank) for rank in range(3)]
    assert shares == [["a", "d"], ["b"], ["c"]]  # "x": read by no rank; "gone": not in the manifest
    assert all(name in reads[rank] for rank, share in enumerate(shares) for name in share)


def test_fp16_optimizers_masters_are_found_and_rounded_back():
    """DeepSpeed's FP16_Optimizer (fused Adam: one flat fp32 tensor per group) and FP16_UnfusedOptimizer (one fp32
    copy per parameter) at ZeRO-0: a parameter's master and moments are its slice, and a load rounds them back."""
    from types import SimpleNamespace

    from torch._utils import _flatten_dense_tensors

    from toolkit.train.checkpoint.sharded import _round_masters, fragment_values

    params = [torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    flat = _flatten_dense_tensors([torch.arange(6.0), torch.arange(6.0, 10.0)])
    fused = SimpleNamespace(fp16_groups=[params], fp32_groups_flat=[flat])
    copies = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0)]
    unfused = SimpleNamespace(fp16_groups=[params], fp32_groups=[copies])
    for wrapper, key in ((fused, flat), (unfused, copies[1])):
        wrapper.optimizer = SimpleNamespace(state={key: {"exp_avg": key * 2, "exp_avg_sq": key * 3}})
        values = fragment_values(SimpleNamespace(optimizer=wrapper), params[1], start=1, stop=3)
        assert torch.equal(values["master"], torch.tensor([7.0, 8.0]))
        assert torch.equal(values["exp_avg_sq"], torch.tensor([21.0, 24.0]))
        _round_masters(wrapper)
        assert torch.equal(params[1], torch.arange(6.0, 10.0, dtype=torch.bfloat16))
        params[1].zero_()
