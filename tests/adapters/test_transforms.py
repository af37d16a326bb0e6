"""The transform kinds alone: pure functions on small hand-made tensors."""

import pytest
import torch

from toolkit.adapters import transforms
from toolkit.adapters.transforms import Kind, ShapeContext
from toolkit.models.shapes import padded_vocab_size

# 4 query heads, 2 KV groups, head_dim 1, hidden 3: rows are easy to follow by value.
CTX = ShapeContext(num_attention_heads=4, num_query_groups=2, head_dim=1, vocab_size=5, padded_vocab_size=8)


def rows(*values):
    return torch.tensor([[v] * 3 for v in values], dtype=torch.float32)


def test_merge_qkv_interleaves_per_query_group():
    q, k, v = rows(0, 1, 2, 3), rows(10, 11), rows(20, 21)
    fused = transforms.merge_qkv(q, k, v, num_query_groups=2)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1 (not q0..q3 k0 k1 v0 v1, the naive concatenation)
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert not torch.equal(fused, torch.cat([q, k, v]))


def test_split_qkv_inverts_merge_exactly_for_weights_and_biases():
    ctx = ShapeContext(num_attention_heads=8, num_query_groups=2, head_dim=4, vocab_size=10, padded_vocab_size=16)
    q, k, v = torch.randn(32, 16), torch.randn(8, 16), torch.randn(8, 16)
    for tensors in ((q, k, v), (q[:, 0], k[:, 0], v[:, 0])):  # weight, then bias-shaped (1-D)
        back = transforms.split_qkv(transforms.merge_qkv(*tensors, num_query_groups=2), ctx=ctx)
        assert all(torch.equal(a, b) for a, b in zip(back, tensors))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_tp_shards_are_even_slices_of_the_fused_tensor(tp_size):
    fused = transforms.merge_qkv(rows(0, 1, 2, 3), rows(10, 11), rows(20, 21), num_query_groups=2)
    shards = [transforms.shard(Kind.QKV, fused, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    assert torch.equal(torch.cat(shards), fused)
    if tp_size == 2:  # TP == KV heads: each rank holds exactly one whole group
        assert shards[1][:, 0].tolist() == [2, 3, 11, 21]
    if tp_size == 4:  # TP > KV heads: a group is split across two ranks (megatron all-gathers in attention)
        assert shards[0][:, 0].tolist() == [0, 1] and shards[1][:, 0].tolist() == [10, 20]


def test_gate_up_shards_hold_gate_shard_then_up_shard():
    gate, up = rows(0, 1, 2, 3), rows(10, 11, 12, 13)
    assert transforms.merge_gate_up(gate, up, tp_rank=1, tp_size=2)[:, 0].tolist() == [2, 3, 12, 13]
    full = transforms.merge_gate_up(gate, up)
    assert full[:, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert all(torch.equal(a, b) for a, b in zip(transforms.split_gate_up(full), (gate, up)))


def test_vocab_padding_is_zero_rows_and_stripped_on_export():
    table = torch.randn(5, 3)
    padded = transforms.to_megatron(Kind.VOCAB, [table], ctx=CTX)
    assert padded.shape == (8, 3) and torch.equal(padded[5:], torch.zeros(3, 3))
    assert torch.equal(transforms.to_hf(Kind.VOCAB, padded, ctx=CTX)[0], table)
    assert padded_vocab_size(250, multiple=128) == 256
    assert padded_vocab_size(256, multiple=128) == 256


def test_row_and_column_split_dims():
    weight = torch.arange(24.0).reshape(4, 6)
    assert transforms.shard(Kind.ROW, weight, tp_rank=1, tp_size=2).tolist() == weight[:, 3:].tolist()
    assert transforms.shard(Kind.COLUMN, weight, tp_rank=1, tp_size=2).tolist() == weight[2:].tolist()
    assert transforms.shard(Kind.REPLICATED, weight, tp_rank=1, tp_size=2) is weight


@pytest.mark.parametrize("kind,hf_shapes,expected", [
    (Kind.QKV, [(4, 3), (2, 3), (2, 3)], (8, 3)),
    (Kind.GATE_UP, [(7, 3), (7, 3)], (14, 3)),
    (Kind.VOCAB, [(5, 3)], (8, 3)),
    (Kind.ROW, [(3, 9)], (3, 9)),
])
def test_megatron_shape(kind, hf_shapes, expected):
    assert transforms.megatron_shape(kind, hf_shapes, ctx=CTX) == expected


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips_bit_exactly(kind):
    shapes = {Kind.QKV: [(4, 3), (2, 3), (2, 3)], Kind.GATE_UP: [(6, 3), (6, 3)], Kind.VOCAB: [(5, 3)],
              Kind.QKV_PACKED: [(8, 3)]}
    hf = [torch.randn(s, dtype=torch.bfloat16) for s in shapes.get(kind, [(6, 3)])]
    back = transforms.to_hf(kind, transforms.to_megatron(kind, hf, ctx=CTX), ctx=CTX)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, hf))


def test_packed_qkv_equals_qkv_from_the_three_tensors_and_shards_alike():
    q, k, v = rows(0, 1, 2, 3), rows(10, 11), rows(20, 21)
    packed = torch.cat([q, k, v])  # Phi-3 qkv_proj / GPT-2 c_attn (after the transpose) row order
    fused = transforms.to_megatron(Kind.QKV_PACKED, [packed], ctx=CTX)
    assert torch.equal(fused, transforms.to_megatron(Kind.QKV, [q, k, v], ctx=CTX))
    assert transforms.megatron_shape(Kind.QKV_PACKED, [tuple(packed.shape)], ctx=CTX) == tuple(fused.shape)
    assert transforms.expected_hf_shapes(Kind.QKV_PACKED, tuple(fused.shape), ctx=CTX) == [tuple(packed.shape)]
    assert torch.equal(transforms.to_hf(Kind.QKV_PACKED, fused, ctx=CTX)[0], packed)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_packed_gate_up_shards_hold_gate_shard_then_up_shard(tp_size):
    gate, up = rows(0, 1, 2, 3), rows(10, 11, 12, 13)
    packed = torch.cat([gate, up])  # Phi-3 gate_up_proj
    full = transforms.to_megatron(Kind.GATE_UP_PACKED, [packed], ctx=CTX)
    for rank in range(tp_size):
        expected = transforms.merge_gate_up(gate, up, tp_rank=rank, tp_size=tp_size)
        assert torch.equal(transforms.shard(Kind.GATE_UP_PACKED, full, tp_rank=rank, tp_size=tp_size), expected)
        assert torch.equal(transforms.shard(Kind.GATE_UP, full, tp_rank=rank, tp_size=tp_size), expected)
    assert torch.equal(transforms.to_hf(Kind.GATE_UP_PACKED, full, ctx=CTX)[0], packed)


def test_conv1d_storage_is_transposed_both_ways_bit_exactly():
    stored = torch.randn(3, 8, dtype=torch.bfloat16)  # GPT-2 Conv1D: [in, out]
    linear = transforms.from_hf_storage(stored, transposed=True)
    assert linear.shape == (8, 3) and linear.is_contiguous() and torch.equal(linear, stored.t())
    assert torch.equal(transforms.to_hf_storage(linear, transposed=True), stored)
    assert transforms.hf_storage_shape((3, 8), transposed=True) == (8, 3)
    assert transforms.from_hf_storage(stored, transposed=False) is stored


@pytest.mark.parametrize("tp_size", [1, 2])
def test_interleaved_gate_up_takes_even_rows_as_gate_and_shards_as_gate_up(tp_size):
    gate, up = rows(0, 1, 2, 3), rows(10, 11, 12, 13)
    interleaved = torch.stack([gate, up], dim=1).reshape(8, 3)  # GPT-OSS's gate_up_proj rows: gate, up, gate, up...
    assert interleaved[:, 0].tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
    full = transforms.to_megatron(Kind.GATE_UP_INTERLEAVED, [interleaved], ctx=CTX)
    assert torch.equal(full, transforms.merge_gate_up(gate, up))
    for rank in range(tp_size):
        expected = transforms.merge_gate_up(gate, up, tp_rank=rank, tp_size=tp_size)
        assert torch.equal(transforms.shard(Kind.GATE_UP_INTERLEAVED, full, tp_rank=rank, tp_size=tp_size), expected)
    assert torch.equal(transforms.to_hf(Kind.GATE_UP_INTERLEAVED, full, ctx=CTX)[0], interleaved)
    assert transforms.expected_hf_shapes(Kind.GATE_UP_INTERLEAVED, (8, 3), ctx=CTX) == [(8, 3)]
