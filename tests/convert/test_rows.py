"""The row-block maps of rows.py against the transforms they stand for (transforms.py is the reference)."""

import pytest
import torch

from toolkit.adapters import transforms
from toolkit.adapters.transforms import Kind, ShapeContext
from toolkit.convert.rows import Block, hf_blocks, megatron_blocks, within

CTX = ShapeContext(num_attention_heads=8, num_query_groups=2, head_dim=4, vocab_size=10, padded_vocab_size=16)
GEN = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=GEN)


CASES = {
    "qkv": (Kind.QKV, [rand(32, 3), rand(8, 3), rand(8, 3)]),
    "qkv_bias": (Kind.QKV, [rand(32), rand(8), rand(8)]),
    "qkv_packed": (Kind.QKV_PACKED, [rand(48, 3)]),
    "gate_up": (Kind.GATE_UP, [rand(6, 3), rand(6, 3)]),
    "gate_up_packed": (Kind.GATE_UP_PACKED, [rand(12, 3)]),
    "gate_up_interleaved": (Kind.GATE_UP_INTERLEAVED, [rand(12, 3)]),
    "gate_up_interleaved_bias": (Kind.GATE_UP_INTERLEAVED, [rand(12)]),
    "vocab": (Kind.VOCAB, [rand(10, 3)]),
    "column": (Kind.COLUMN, [rand(5, 3)]),
    "row": (Kind.ROW, [rand(3, 5)]),
    "replicated": (Kind.REPLICATED, [rand(7)]),
}


def gather(blocks, hf, rest):
    parts = [torch.zeros(b.num_rows, *rest) if b.hf_index is None else hf[b.hf_index][b.hf_start:b.hf_start + b.num_rows]
             for b in blocks]
    return torch.cat(parts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_blocks_rebuild_the_megatron_tensor_and_the_hf_tensors(case):
    kind, hf = CASES[case]
    megatron = transforms.to_megatron(kind, hf, ctx=CTX)
    blocks = megatron_blocks(kind, hf_rows=[t.shape[0] for t in hf], ctx=CTX)
    assert torch.equal(gather(blocks, hf, megatron.shape[1:]), megatron)
    assert sum(b.num_rows for b in blocks) == megatron.shape[0]
    for index, expected in enumerate(transforms.to_hf(kind, megatron, ctx=CTX)):
        mine = hf_blocks(blocks, hf_index=index)
        # the blocks tile the HF tensor top to bottom, and read from the megatron tensor they give it back
        assert [b.hf_start for b in mine] == [sum(b.num_rows for b in mine[:i]) for i in range(len(mine))]
        assert torch.equal(torch.cat([megatron[b.megatron_start:b.megatron_start + b.num_rows] for b in mine]), expected)


def test_qkv_interleaves_per_query_group():
    blocks = megatron_blocks(Kind.QKV, hf_rows=[32, 8, 8], ctx=CTX)
    assert blocks[:4] == [Block(0, 0, 0, 16), Block(16, 1, 0, 4), Block(20, 2, 0, 4), Block(24, 0, 16, 16)]


@pytest.mark.parametrize("start,stop", [(0, 6), (6, 12), (4, 9), (0, 12)])
def test_within_cuts_and_rebases_a_row_range(start, stop):
    kind, hf = CASES["gate_up"]
    blocks = megatron_blocks(kind, hf_rows=[6, 6], ctx=CTX)
    megatron = transforms.to_megatron(kind, hf, ctx=CTX)
    part = within(blocks, start=start, stop=stop)
    assert part[0].megatron_start == 0
    assert torch.equal(gather(part, hf, (3,)), megatron[start:stop])
    assert within(blocks, start=6, stop=12) == [Block(0, 1, 0, 6)]  # fc1's stored "up" chunk is the up tensor
