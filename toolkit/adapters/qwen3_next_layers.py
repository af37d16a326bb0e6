"""Qwen3-Next's token mixers as megatron modules (local layers): the Gated DeltaNet layer, the gated full-attention
projection, and the per-layer choice between them (`TokenMixer`, by the layer's global number).

Why not megatron-core's own `GatedDeltaNet` (megatron/core/ssm/gated_delta_net.py): its fused `in_proj` holds, on
each TP rank, [q_r | k_r | v_r | z_r | beta_r | alpha_r] and its conv1d [q_r | k_r | v_r]; neither is one
TP-independent tensor that dsmt's closed set of weight kinds (toolkit/adapters/transforms.py) can shard. It also
needs `fla` to construct at all, and its out_norm would follow the model's zero-centred gamma while HF's gated norm
is a plain one. This module keeps HF's own tensors instead, each a standard kind:
  in_proj_qkvz  HF's rows, grouped per key head g: [q_g | k_g | v_g | z_g] (v / z: that key head's value heads).
                COLUMN: with tp dividing linear_num_key_heads each rank holds whole key-head groups.
  in_proj_ba    [b_g | a_g] per key head: COLUMN, likewise.
  A_log, dt_bias  one per value head, value heads numbered g * (nv / nk) + j: COLUMN.
  conv1d.weight  HF's [all q | all k | all v] channels: REPLICATED (it is [conv_dim, 1, kernel], small); each rank
                convolves its own channels, and its gradient is all-reduced over TP in the backward
                (`copy_to_tensor_model_parallel_region`), so the copies stay equal.
  norm.weight   the gated RMSNorm over each value head: REPLICATED, its gradient all-reduced the same way.
  out_proj      ROW.
The gated attention keeps HF's q_proj rows ([q_h | gate_h] per head), k_proj and v_proj as three COLUMN weights
behind megatron's `linear_qkv` (megatron's `attention_output_gate` then applies sigmoid(gate) before linear_proj).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from toolkit.adapters.packed import record_starts_from_mask
from toolkit.backend import cpu_gdn


def _tp_group(pg_collection):
    from megatron.core import parallel_state

    return pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()


class TokenMixer:
    """The layer's token mixer by HF's `layer_types[global layer]`: Gated DeltaNet for "linear_attention", the
    gated attention spec otherwise. A class, not a function (megatron's `build_module` returns functions uncalled);
    it returns the chosen module itself, so parameter names are the mixer's own (`self_attention.in_proj_qkvz`)."""

    def __new__(cls, *, config, layer_number: int, layer_types: tuple[str, ...], attention, pg_collection=None,
                submodules=None, **kwargs):
        if layer_types[layer_number - 1] == "linear_attention":  # megatron's layer_number: global, 1-based
            return GatedDeltaNetMixer(config=config, layer_number=layer_number, pg_collection=pg_collection)
        return build_module(attention, config=config, layer_number=layer_number, pg_collection=pg_collection,
                            **kwargs)


class GatedQkvProjection(torch.nn.Module):
    """megatron's `linear_qkv` for gated attention from HF's q_proj (per head [q_h | gate_h]), k_proj, v_proj, each
    a column-parallel weight (tp divides num_key_value_heads: each rank holds whole KV groups). Its output is what
    megatron's attention with `attention_output_gate` splits, per local KV group: [q heads | gate heads | k | v]."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, tp_group=None, **unused):
        super().__init__()
        self.head_dim, self.num_groups = config.kv_channels, config.num_query_groups

        def column(rows: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(input_size, rows, config=config, init_method=init_method, gather_output=False,
                                        bias=False, skip_bias_add=False, is_expert=is_expert, tp_group=tp_group)

        self.q = column(2 * config.num_attention_heads * self.head_dim)
        self.k = column(self.num_groups * self.head_dim)
        self.v = column(self.num_groups * self.head_dim)

    def forward(self, hidden_states: torch.Tensor):
        (q_and_gate, _), (key, _), (value, _) = self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)
        seq, batch = key.shape[:2]
        groups = key.shape[-1] // self.head_dim  # this rank's KV groups
        q_and_gate = q_and_gate.reshape(seq, batch, groups, -1, 2, self.head_dim)
        query, gate = (q_and_gate[..., i, :].reshape(seq, batch, groups, -1) for i in (0, 1))
        parts = (query, gate, key.reshape(seq, batch, groups, -1), value.reshape(seq, batch, groups, -1))
        return torch.cat(parts, dim=-1).reshape(seq, batch, -1), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Each projection as the column-parallel weight it is (a plain module's would read as replicated)."""
        result = {}
        for name in ("q", "k", "v"):
            result.update(getattr(self, name).sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return result


class LocalConvWeight(torch.nn.Module):
    """HF's depthwise conv1d.weight [channels, 1, kernel], whole on every TP rank. Called, it returns this rank's
    channels [its q | its k | its v] as [channels, kernel] (a module call, so ZeRO-3 gathers the weight for it);
    the whole weight's gradient is all-reduced over TP, each rank's channels coming from its own backward."""

    def __init__(self, channels: int, kernel: int, *, slices, tp_group, dtype):
        super().__init__()
        self.slices, self.tp_group = slices, tp_group
        self.weight = torch.nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Conv1d's init (a checkpoint load overwrites it)

    def forward(self) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight, group=self.tp_group)
        return torch.cat([weight[start:start + width] for start, width in self.slices]).squeeze(1)


class GatedRMSNorm(torch.nn.Module):
    """HF's Qwen3NextRMSNormGated: RMSNorm in fp32 (plain weight, not zero-centred), cast back, times the weight,
    times silu(gate) in fp32, cast back."""

    def __init__(self, size: int, *, eps: float, tp_group):
        super().__init__()
        self.weight, self.eps, self.tp_group = torch.nn.Parameter(torch.ones(size)), eps, tp_group

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight, group=self.tp_group)  # each rank's heads add to it
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (weight * normed * F.silu(gate.float())).to(x.dtype)


def record_spans(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) columns of each packed record (and of the padding after them)."""
    starts = record_starts_from_mask(mask)
    spans = []
    for row in starts:
        begins = torch.nonzero(row).flatten().tolist() + [row.numel()]
        spans.append(list(zip(begins[:-1], begins[1:])))
    return spans


def per_record(fn, *tensors: torch.Tensor, spans: list[list[tuple[int, int]]], dim: int) -> torch.Tensor:
    """`fn` over each record of each row (`tensors` batch-first, records along `dim`), put back in place: no
    state or conv window crosses from one record into the next."""
    rows = []
    for row, row_spans in enumerate(spans):
        rows.append(torch.cat([fn(*(t[row:row + 1].narrow(dim, start, end - start) for t in tensors))
                               for start, end in row_spans], dim=dim))
    return torch.cat(rows, dim=0)


class GatedDeltaNetMixer(MegatronModule):
    """Qwen3-Next's linear-attention layer (HF Qwen3NextGatedDeltaNet), training form (no recurrent / conv state).
    Input and output [s, b, hidden], as megatron's attention; returns (output, bias=None)."""

    def __init__(self, *, config, layer_number: int, pg_collection=None):
        super().__init__(config)
        self.layer_number, self.tp_group = layer_number, _tp_group(pg_collection)
        tp_group = self.tp_group
        tp_size = tp_group.size()
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
        self.values_per_key = num_v // num_k
        self.local_k_heads, self.local_v_heads = num_k // tp_size, num_v // tp_size
        hidden, group_rows = config.hidden_size, 2 * self.key_dim + 2 * self.values_per_key * self.value_dim

        def column(rows: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(hidden, rows, config=config, init_method=config.init_method,
                                        gather_output=False, bias=False, skip_bias_add=True, tp_group=tp_group)

        self.in_proj_qkvz, self.in_proj_ba = column(num_k * group_rows), column(2 * num_v)
        # HF's conv channels [all q | all k | all v]: (start, width) of this rank's q, k and v channels
        rank, qk_all, qk_local = tp_group.rank(), num_k * self.key_dim, self.local_k_heads * self.key_dim
        v_local = self.local_v_heads * self.value_dim
        slices = ((rank * qk_local, qk_local), (qk_all + rank * qk_local, qk_local), (2 * qk_all + rank * v_local,
                                                                                     v_local))
        dtype = config.params_dtype
        self.conv1d = LocalConvWeight(2 * qk_all + num_v * self.value_dim, config.linear_conv_kernel_dim,
                                      slices=slices, tp_group=tp_group, dtype=dtype)
        # HF's init (every checkpoint load overwrites it): A uniform in (0, 16), stored as its log
        self.A_log = torch.nn.Parameter(torch.empty(self.local_v_heads, dtype=dtype).uniform_(0, 16).log())
        self.dt_bias = torch.nn.Parameter(torch.ones(self.local_v_heads, dtype=dtype))
        for param in (self.A_log, self.dt_bias):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.norm = GatedRMSNorm(self.value_dim, eps=config.layernorm_epsilon, tp_group=tp_group).to(dtype)
        self.out_proj = RowParallelLinear(num_v * self.value_dim, hidden, config=config, bias=False,
                                          init_method=config.output_layer_init_method, input_is_parallel=True,
                                          skip_bias_add=True, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **unused):
        """`attention_mask`: None, or packed records' block-diagonal mask (toolkit/adapters/packed.py), whose
        records the conv and the delta rule then run over one by one, as each record alone."""
        spans = None if attention_mask is None else record_spans(attention_mask)
        qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        seq, batch = qkvz.shape[:2]
        qkvz = qkvz.transpose(0, 1).reshape(batch, seq, self.local_k_heads, -1)
        v_rows = self.values_per_key * self.value_dim
        query, key, value, z = torch.split(qkvz, [self.key_dim, self.key_dim, v_rows, v_rows], dim=-1)
        b, a = torch.split(ba.transpose(0, 1).reshape(batch, seq, self.local_k_heads, -1), self.values_per_key, dim=-1)
        mixed = torch.cat([t.reshape(batch, seq, -1) for t in (query, key, value)], dim=-1).transpose(1, 2)
        conv = functools.partial(cpu_gdn.causal_conv1d, weight=self.conv1d(), activation=F.silu)
        mixed = (conv(mixed) if spans is None else per_record(conv, mixed, spans=spans, dim=2)).transpose(1, 2)
        qk_local = self.local_k_heads * self.key_dim
        query, key, value = torch.split(mixed, [qk_local, qk_local, mixed.shape[-1] - 2 * qk_local], dim=-1)
        beta = b.reshape(batch, seq, -1).sigmoid()
        # fp32 decay (HF: a half-precision A could overflow to -inf)
        g = -self.A_log.float().exp() * F.softplus(a.reshape(batch, seq, -1).float() + self.dt_bias)
        inputs = (query.reshape(batch, seq, -1, self.key_dim), key.reshape(batch, seq, -1, self.key_dim),
                  value.reshape(batch, seq, -1, self.value_dim), g, beta)
        rule = cpu_gdn.gated_delta_rule  # fla's kernel or the torch rule, per call
        out = rule(*inputs) if spans is None else per_record(rule, *inputs, spans=spans, dim=1)
        out = self.norm(out, z.reshape(batch, seq, -1, self.value_dim))
        return self.out_proj(out.reshape(batch, seq, -1).transpose(0, 1).contiguous())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """A_log and dt_bias split over TP on dim 0 (megatron's default would call them replicated); the rest as
        their modules say (conv1d and norm weights replicated)."""
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint, sharded_state_dict_default)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        groups = dict(tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])  # replicas named per TP / DP rank
        own = {name: param for name, param in self.named_parameters(recurse=False)}
        result = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets, **groups)
        for name, module in self.named_children():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                result.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                         tp_group=self.tp_group))
            else:  # the replicated conv and norm weights
                result.update(make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True),
                                                                  f"{prefix}{name}.", {}, sharded_offsets, **groups))
        return result
