"""The closed set of weight transform kinds between HF tensors and megatron-core parameters, as pure functions.

Every megatron parameter is one of these kinds (see `families/*.py` for which is which):

  REPLICATED  same tensor on every TP rank (norm weights).
  COLUMN      split on dim 0 across TP ranks (ColumnParallelLinear outputs).
  ROW         split on dim 1 across TP ranks (RowParallelLinear: o_proj, down_proj).
  VOCAB       vocab-parallel embedding / output layer: rows padded with zeros up to `padded_vocab_size`
              (a multiple of the padding unit, so one checkpoint serves every TP), then split on dim 0.
  QKV         fused attention projection. megatron orders rows per query group:
                  [ q heads of group 0 | k0 | v0 | q heads of group 1 | k1 | v1 | ... ]
              and each TP rank holds an even, contiguous slice of that fused tensor: whole groups when
              TP <= KV heads, part of one group when TP > KV heads (megatron all-gathers inside attention).
              Concatenating q, k, v without this interleave is the classic GQA conversion bug.
  GATE_UP     fused SwiGLU input projection. Each TP rank holds [gate shard r ; up shard r]; the layout-free
              (TP=1) tensor is [gate ; up].
  QKV_PACKED  QKV from ONE HF tensor whose rows are [all q ; all k ; all v] (Phi-3's qkv_proj, GPT-2's c_attn):
              split into q, k, v, then as QKV.
  GATE_UP_PACKED  GATE_UP from ONE HF tensor [gate ; up] (Phi-3's gate_up_proj): already the layout-free tensor.
  GATE_UP_INTERLEAVED  GATE_UP from ONE HF tensor whose rows alternate [gate 0 ; up 0 ; gate 1 ; up 1 ; ...]
              (GPT-OSS's experts.gate_up_proj, after the transpose, and its bias): rows 0::2 are gate, 1::2 up.

A row may also be `transposed` (family.py): the HF tensor is stored [in, out] (GPT-2's Conv1D) and is transposed
on the way in and back on the way out (`from_hf_storage` / `to_hf_storage`); a transpose is exact.

Functions work on any trailing shape, so the same code serves weights ([rows, hidden]) and biases ([rows]).
"""

from __future__ import annotations

import dataclasses
import enum

import torch


class Kind(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATE_UP = "gate_up"
    QKV_PACKED = "qkv_packed"
    GATE_UP_PACKED = "gate_up_packed"
    GATE_UP_INTERLEAVED = "gate_up_interleaved"


# How many HF tensors each kind combines.
HF_ARITY = {Kind.REPLICATED: 1, Kind.COLUMN: 1, Kind.ROW: 1, Kind.VOCAB: 1, Kind.QKV: 3, Kind.GATE_UP: 2,
            Kind.QKV_PACKED: 1, Kind.GATE_UP_PACKED: 1, Kind.GATE_UP_INTERLEAVED: 1}


@dataclasses.dataclass(frozen=True)
class ShapeContext:
    """The model facts the transforms need."""

    num_attention_heads: int
    num_query_groups: int  # = HF num_key_value_heads
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


# ---- QKV -----------------------------------------------------------------------------------------------------


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int) -> torch.Tensor:
    """HF q [nh*d, ...], k [ng*d, ...], v [ng*d, ...] -> megatron fused [(nh + 2*ng)*d, ...], grouped per KV head."""
    rest = q.shape[1:]
    q_groups = q.reshape(num_query_groups, -1, *rest)
    k_groups = k.reshape(num_query_groups, -1, *rest)
    v_groups = v.reshape(num_query_groups, -1, *rest)
    return torch.cat([q_groups, k_groups, v_groups], dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, *, ctx: ShapeContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv` on the layout-free (TP=1) fused tensor."""
    rest = fused.shape[1:]
    heads_per_group = ctx.num_attention_heads // ctx.num_query_groups
    grouped = fused.reshape(ctx.num_query_groups, (heads_per_group + 2) * ctx.head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * ctx.head_dim, ctx.head_dim, ctx.head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def unpack_qkv(packed: torch.Tensor, *, ctx: ShapeContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[q rows ; k rows ; v rows] (one HF tensor) -> q, k, v."""
    q_rows, kv_rows = ctx.num_attention_heads * ctx.head_dim, ctx.num_query_groups * ctx.head_dim
    q, k, v = torch.split(packed, [q_rows, kv_rows, kv_rows], dim=0)
    return q, k, v


# ---- gate / up -----------------------------------------------------------------------------------------------


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """TP rank `tp_rank`'s fused fc1: [gate shard ; up shard]. With tp_size=1 this is the layout-free [gate ; up]."""
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `merge_gate_up` at tp_size=1."""
    gate, up = fused.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def deinterleave_gate_up(interleaved: torch.Tensor) -> torch.Tensor:
    """[gate 0 ; up 0 ; gate 1 ; up 1 ; ...] (rows) -> the layout-free [gate ; up]."""
    return torch.cat([interleaved[0::2], interleaved[1::2]], dim=0)


def interleave_gate_up(fused: torch.Tensor) -> torch.Tensor:
    """Inverse of `deinterleave_gate_up`: the layout-free [gate ; up] -> rows alternating gate, up."""
    gate, up = fused.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(fused.shape).contiguous()


# ---- vocab padding -------------------------------------------------------------------------------------------


def pad_vocab(table: torch.Tensor, *, padded_size: int) -> torch.Tensor:
    """Append zero rows: padded token ids never occur in data, and zero output rows give logit 0 for them."""
    if table.shape[0] == padded_size:
        return table
    padding = table.new_zeros((padded_size - table.shape[0], *table.shape[1:]))
    return torch.cat([table, padding], dim=0)


def strip_vocab(table: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    return table[:vocab_size].contiguous()


# ---- HF storage order ----------------------------------------------------------------------------------------


def from_hf_storage(tensor: torch.Tensor, *, transposed: bool) -> torch.Tensor:
    """An HF tensor in torch.nn.Linear's [out, in] order (Conv1D stores [in, out])."""
    return tensor.t().contiguous() if transposed else tensor


def to_hf_storage(tensor: torch.Tensor, *, transposed: bool) -> torch.Tensor:
    return tensor.t().contiguous() if transposed else tensor


def hf_storage_shape(shape: tuple[int, ...], *, transposed: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transposed else tuple(shape)


# ---- per-kind dispatch ---------------------------------------------------------------------------------------


def to_megatron(kind: Kind, hf: list[torch.Tensor], *, ctx: ShapeContext) -> torch.Tensor:
    """HF tensors -> the layout-free (TP=1) megatron tensor."""
    if kind is Kind.QKV:
        return merge_qkv(*hf, num_query_groups=ctx.num_query_groups)
    if kind is Kind.QKV_PACKED:
        return merge_qkv(*unpack_qkv(hf[0], ctx=ctx), num_query_groups=ctx.num_query_groups)
    if kind is Kind.GATE_UP:
        return merge_gate_up(*hf)
    if kind is Kind.GATE_UP_INTERLEAVED:
        return deinterleave_gate_up(hf[0])
    if kind is Kind.VOCAB:
        return pad_vocab(hf[0], padded_size=ctx.padded_vocab_size)
    return hf[0]  # REPLICATED, COLUMN, ROW, GATE_UP_PACKED


def to_hf(kind: Kind, tensor: torch.Tensor, *, ctx: ShapeContext) -> list[torch.Tensor]:
    """The layout-free megatron tensor -> HF tensors (inverse of `to_megatron`, bit-exact)."""
    if kind is Kind.QKV:
        return list(split_qkv(tensor, ctx=ctx))
    if kind is Kind.QKV_PACKED:
        return [torch.cat(split_qkv(tensor, ctx=ctx), dim=0)]
    if kind is Kind.GATE_UP:
        return list(split_gate_up(tensor))
    if kind is Kind.GATE_UP_INTERLEAVED:
        return [interleave_gate_up(tensor)]
    if kind is Kind.VOCAB:
        return [strip_vocab(tensor, vocab_size=ctx.vocab_size)]
    return [tensor]


def shard(kind: Kind, full: torch.Tensor, *, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s slice of the layout-free megatron tensor. A fused gate/up tensor [gate ; up] gives
    [gate shard ; up shard] (`merge_gate_up`), not a plain row block."""
    if kind in (Kind.GATE_UP, Kind.GATE_UP_PACKED, Kind.GATE_UP_INTERLEAVED):
        return merge_gate_up(*split_gate_up(full), tp_rank=tp_rank, tp_size=tp_size)
    if kind is Kind.REPLICATED:
        return full
    dim = 1 if kind is Kind.ROW else 0
    return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def megatron_shape(kind: Kind, hf_shapes: list[tuple[int, ...]], *, ctx: ShapeContext) -> tuple[int, ...]:
    """Shape of the layout-free megatron tensor made from HF tensors of these shapes."""
    first = tuple(hf_shapes[0])
    if kind in (Kind.QKV, Kind.GATE_UP):  # the packed kinds: one HF tensor of the megatron shape
        return (sum(shape[0] for shape in hf_shapes), *first[1:])
    if kind is Kind.VOCAB:
        return (ctx.padded_vocab_size, *first[1:])
    return first


def expected_hf_shapes(kind: Kind, megatron_shape_: tuple[int, ...], *, ctx: ShapeContext) -> list[tuple[int, ...]]:
    """The HF shapes a layout-free megatron tensor of this shape must come from (used to name shape errors)."""
    rest = tuple(megatron_shape_[1:])
    if kind is Kind.QKV:
        q_rows, kv_rows = ctx.num_attention_heads * ctx.head_dim, ctx.num_query_groups * ctx.head_dim
        return [(q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)]
    if kind is Kind.GATE_UP:
        return [(megatron_shape_[0] // 2, *rest)] * 2
    if kind is Kind.QKV_PACKED:
        return [((ctx.num_attention_heads + 2 * ctx.num_query_groups) * ctx.head_dim, *rest)]
    if kind is Kind.VOCAB:
        return [(ctx.vocab_size, *rest)]
    return [tuple(megatron_shape_)]
