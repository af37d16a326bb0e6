"""Packed sequences on megatron-core's GPTModel: several records in one row, each attending only to itself.

The data (toolkit/data/tokenize.py, `data.packing`) marks the records of a row by their `position_ids`, which
restart at 0 at each record: a 0 after column 0 is a boundary. Two things must then follow the records:

* attention. megatron's local attention (`DotProductAttention`, torch softmax) takes an explicit boolean mask
  [b, 1, s, s], True = masked (`attention_mask_func` fills -10000 there), and with an explicit mask it does not
  add its own causal one: `packed_attention_mask` is block-diagonal AND causal. Transformer Engine's attention
  ("fused", GPU) takes the THD layout instead: `thd_packed_seq_params` gives megatron's `PackedSeqParams`
  (cu_seqlens over the micro-batch flattened to one row; TE switches to padding_causal itself).
* RoPE. GPTModel computes rotary frequencies for positions 0 .. s-1 and ignores `position_ids` for them (learned
  absolute embeddings do read them). `use_position_ids_for_rope` replaces `model.rotary_pos_emb` by
  `PositionRotary`, which returns per-token frequencies [s, b, 1, d] gathered by the batch's position ids; megatron's
  unfused `apply_rotary_pos_emb` broadcasts them over the heads. A forward pre-hook on the GPTModel hands it the
  call's `position_ids`, so every pipeline stage (each is called with the batch) rotates by the record positions.
  Under THD megatron's own per-sequence RoPE applies and the wrapper steps aside. Multi-latent attention (DeepSeek)
  rotates inside its attention module at the row's positions 0 .. s-1, which the mask makes harmless: RoPE scores
  depend on relative positions only (YaRN too), so each record attends as alone, within rounding
  (tests/adapters/test_deepseek.py).

A micro-batch without a boundary (every row one record: unpacked data, synthetic data) takes the plain path: no
mask, megatron's own causal attention and RoPE, bit for bit as before.
"""

from __future__ import annotations

import contextlib

import torch

from toolkit.errors import DsmtError


def has_packed_boundary(position_ids: torch.Tensor) -> bool:
    """True when some row holds more than one record (a position 0 after column 0)."""
    return bool((position_ids[:, 1:] == 0).any())


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int: the record each token belongs to, counted from 1 in each row (a record starts at position 0)."""
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=1)


def record_starts_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [b, s]: where a record starts in rows given a `packed_attention_mask` [b, 1, s, s] (True = masked): at
    column 0 and wherever a token may not see the one before it. Layers read the records from the mask they are
    called with (an argument, so activation recompute sees the same micro-batch's records)."""
    cannot_see_previous = torch.diagonal(mask[:, 0], offset=-1, dim1=-2, dim2=-1).to(torch.bool)  # [b, s - 1]
    first = torch.ones_like(cannot_see_previous[:, :1])
    return torch.cat([first, cannot_see_previous], dim=1)


def record_positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """int64 [b, s]: each token's position within its record (0 at each record start), read from a packed mask."""
    starts = record_starts_from_mask(mask)
    columns = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    record_start = torch.cummax(torch.where(starts, columns, torch.zeros_like(columns)), dim=1).values
    return columns - record_start


def packed_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, s, s], True where query t must NOT see key k: k in another record, or k after t."""
    segments = segment_ids(position_ids)
    same_record = segments[:, :, None] == segments[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ~(same_record & causal)[:, None, :, :]


def record_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, max_seqlen) of the micro-batch flattened to one row of b*s tokens: int32 offsets of every record
    start (each row starts one) and of the end, on the position ids' device; the longest record. Read on the host
    when the batch is built (toolkit/train/engine/step_inputs.py): on a GPU tensor each `int()` here would wait."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    if len(starts) == 0 or int(starts[0]) != 0:
        raise DsmtError("packed rows must start at position 0 (each row starts a record); got position_ids "
                        f"{position_ids[:, :4].tolist()} ...: the data is not dsmt's (toolkit/data/tokenize.py)")
    cu_seqlens = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def thd_packed_seq_params(*, cu_seqlens: torch.Tensor, max_seqlen: int):
    """megatron's `PackedSeqParams` for the micro-batch flattened to one row (`record_boundaries`; cu_seqlens on the
    model's device)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


class PositionRotary(torch.nn.Module):
    """megatron's RotaryEmbedding, but at the call's position ids when they restart (packed records).

    `position_ids` is set per forward by the GPTModel pre-hook (None: no packed call, megatron's own positions);
    `longest_record` by the caller that knows it on the host (`longest_record`; None: the row's length). It holds no
    parameters or buffers (megatron's `inv_freq` is a plain attribute), so state dicts are unchanged."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.position_ids: torch.Tensor | None = None
        self.longest_record: int | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        positions = self.position_ids
        if positions is None or packed_seq or offset != 0 or positions.shape[1] != max_seq_len:
            return self.inner(max_seq_len, offset, packed_seq=packed_seq, cp_group=cp_group)
        # The table of positions 0 .. m-1, m = the longest record (= max(position_ids) + 1, HF's length, by which
        # Phi-3's long-RoPE picks its factors), known on the host; not positions.max(), which would wait for the GPU
        # in every forward. Without it, the row's length: positions restart inside a row, so none reaches it.
        length = self.longest_record or max_seq_len
        table = self.inner(length)  # [m, 1, 1, d]
        if table.shape[0] != length:  # megatron cut it for a CP rank: packing refuses CP
            raise DsmtError("packed records under context parallelism: set data.packing: false or parallel.cp: 1")
        return table[:, 0, 0, :][positions.to(table.device)].transpose(0, 1).unsqueeze(2)  # [s, b, 1, d]


@contextlib.contextmanager
def longest_record(model: torch.nn.Module, length: int):
    """Inside, the `PositionRotary` wrappers of `model` (a chunk, or DeepSpeed's engine around one or a ModuleList of
    them) size their table by `length`, the call's longest record (toolkit/train/engine/step_inputs.py reads it on
    the host)."""
    module = getattr(model, "module", model)
    rotaries = getattr(module, "_dsmt_rotaries", None)
    if rotaries is None:
        rotaries = [m for m in module.modules() if isinstance(m, PositionRotary)]
        module._dsmt_rotaries = rotaries
    for rotary in rotaries:
        rotary.longest_record = length
    try:
        yield
    finally:
        for rotary in rotaries:
            rotary.longest_record = None


def use_position_ids_for_rope(model: torch.nn.Module) -> None:
    """Make a RoPE GPTModel rotate by its call's `position_ids` when they hold packed records (see the module
    docstring); models without rotary embeddings are left as they are."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or isinstance(rotary, PositionRotary):
        return
    model.rotary_pos_emb = wrapper = PositionRotary(rotary)

    def take_positions(module, args, kwargs):
        # The packed call on local layers is the one with an explicit attention mask (toolkit/train/engine/tasks.py:
        # the block-diagonal mask): decided from the call, not from the position ids' values, which are on the
        # device. With positions 0 .. s-1 (no record boundary) the gathered table is megatron's own, bit for bit.
        positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
        mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        packed = kwargs.get("packed_seq_params")
        wrapper.position_ids = positions if positions is not None and mask is not None and packed is None else None

    model.register_forward_pre_hook(take_positions, with_kwargs=True)


def uses_thd(model: torch.nn.Module) -> bool:
    """True when the GPTModel behind `model` (a chunk, or DeepSpeed's engine around one or a ModuleList of them)
    runs Transformer Engine's attention, which takes packed records as THD instead of a mask."""
    module = getattr(model, "module", model)
    cached = getattr(module, "_dsmt_uses_thd", None)
    if cached is None:
        cached = any(type(m).__name__ == "TEDotProductAttention" for m in module.modules())
        module._dsmt_uses_thd = cached
    return cached
