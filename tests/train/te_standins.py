"""Transformer Engine's layers as megatron-core builds them, shaped for a machine without TE: the same class names
as megatron's TE wrappers (megatron/core/extensions/transformer_engine.py), the same parameters, shapes and
tensor-parallel marks, a `_extra_state` in every state dict, megatron's `sharded_state_dict` of each wrapper, and
TE's maths in torch ops (the norm, then the linear). `install()` makes dsmt's own TE branch build them
(toolkit/adapters/layer_specs.py `layer_spec`, through megatron's `get_gpt_layer_with_transformer_engine_spec`).

What they are NOT: TE's kernels (cuDNN / flash attention, fused norm + GEMM, their rounding), fp8 and its metadata
(the extra state is what TE >= 2 stores without fp8: an empty byte tensor, and for the norm ops a pickled empty
dict), userbuffer overlap, delayed weight gradients, sliding-window attention, context parallelism, grouped GEMMs,
TE's fused RoPE (off on the CPU: megatron's unfused RoPE runs). Attention is causal without an explicit mask, or
packed records as megatron hands them to TE (THD, `cu_seqlens`); anything else is refused by name.

Each TE class and its megatron wrapper are two classes here too, as in megatron (wrapper(TE class)): DeepSpeed's
`zero.Init` partitions a module once its outermost `__init__` returns, so the wrapper's work after TE's
`__init__` runs on whole parameters there as well.
"""

from __future__ import annotations

import pickle

import torch
import torch.nn.functional as F


class _TEBaseModule(torch.nn.Module):
    """TE's TransformerEngineBaseModule as checkpoints see it: fp8 metadata as extra state, which without fp8 is
    an empty uint8 tensor (TE >= 2; TE 1 stored an io.BytesIO)."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise NotImplementedError(f"{type(self).__name__} stand-in: fp8 extra state is not reproduced")


def _norm(x, *, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
    gamma = 1 + weight if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), gamma, eps)
    return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)


def _tp_attributes(module) -> None:
    """What TE's `reset_parameters` marks: every weight TP-parallel along its mode's dimension (also at TP 1), a
    column linear's bias sharded with it, a row linear's bias and the norm's parameters `sequence_parallel`."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(module.weight, True, 1 if module.parallel_mode == "row" else 0, 1)
    if module.bias is not None:
        if module.parallel_mode == "column":
            set_tensor_model_parallel_attributes(module.bias, True, 0, 1)
        else:
            module.bias.sequence_parallel = module.sequence_parallel
    for name in ("layer_norm_weight", "layer_norm_bias"):
        if getattr(module, name, None) is not None:
            getattr(module, name).sequence_parallel = module.sequence_parallel


def _parameter(*shape, dtype, fill: float | None = None) -> torch.nn.Parameter:
    """A new parameter; not filled (`fill` None) it holds NaN, so one that the loader missed poisons the loss."""
    return torch.nn.Parameter(torch.full(shape, float("nan") if fill is None else fill, dtype=dtype))


class LayerNormLinear(_TEBaseModule):
    """te.pytorch.LayerNormLinear: `layer_norm_weight` (+ `layer_norm_bias` for LayerNorm), `weight`, `bias`."""

    def __init__(self, in_features: int, out_features: int, *, eps: float, sequence_parallel: bool, tp_group,
                 tp_size: int, bias: bool, return_bias: bool, parallel_mode: str, normalization: str,
                 zero_centered_gamma: bool, params_dtype: torch.dtype, init_method):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features // tp_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.sequence_parallel, self.tp_group, self.tp_size = sequence_parallel, tp_group, tp_size
        self.parallel_mode, self.use_bias, self.return_bias = parallel_mode, bias, return_bias
        self.layer_norm_weight = _parameter(in_features, dtype=params_dtype, fill=0.0 if zero_centered_gamma else 1.0)
        self.layer_norm_bias = _parameter(in_features, dtype=params_dtype, fill=0.0) \
            if normalization == "LayerNorm" else None
        self.weight = _parameter(self.out_features, in_features, dtype=params_dtype)
        init_method(self.weight)
        self.bias = _parameter(self.out_features, dtype=params_dtype, fill=0.0) if bias else None
        _tp_attributes(self)

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel import mappings

        normed = _norm(x, weight=self.layer_norm_weight, bias=self.layer_norm_bias, normalization=self.normalization,
                       eps=self.eps, zero_centered_gamma=self.zero_centered_gamma)
        # TE's column mode: the normed input gathered over the sequence (SP), else its gradient summed over TP
        if self.tp_size > 1 and self.sequence_parallel:
            normed = mappings.gather_from_sequence_parallel_region(normed, group=self.tp_group)
        elif self.tp_size > 1:
            normed = mappings.copy_to_tensor_model_parallel_region(normed, group=self.tp_group)
        out = F.linear(normed, self.weight, None if self.return_bias else self.bias)
        return (out, self.bias) if self.return_bias else out


class Linear(_TEBaseModule):
    """te.pytorch.Linear in row mode (megatron's TERowParallelLinear): the output summed (or reduce-scattered
    over the sequence) over TP, the bias added after."""

    def __init__(self, in_features: int, out_features: int, *, sequence_parallel: bool, tp_group, tp_size: int,
                 bias: bool, return_bias: bool, parallel_mode: str, params_dtype: torch.dtype, init_method):
        super().__init__()
        if parallel_mode != "row":
            raise NotImplementedError(f"te.pytorch.Linear stand-in: parallel_mode={parallel_mode!r} (row only)")
        self.in_features, self.out_features = in_features // tp_size, out_features
        self.sequence_parallel, self.tp_group, self.tp_size = sequence_parallel, tp_group, tp_size
        self.parallel_mode, self.use_bias, self.return_bias = parallel_mode, bias, return_bias
        self.weight = _parameter(out_features, self.in_features, dtype=params_dtype)
        init_method(self.weight)
        self.bias = _parameter(out_features, dtype=params_dtype, fill=0.0) if bias else None
        _tp_attributes(self)

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel import mappings

        out = F.linear(x, self.weight)
        if self.tp_size > 1 and self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        elif self.tp_size > 1:
            out = mappings.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.return_bias:
            return out, self.bias
        return out if self.bias is None else out + self.bias


def _wrapper_forward(module, x):
    """megatron's TE wrappers always return (output, bias or None)."""
    out = LayerNormLinear.forward(module, x) if isinstance(module, LayerNormLinear) else Linear.forward(module, x)
    return out if module.te_return_bias else (out, None)


def _sharded(module, prefix, sharded_offsets, metadata, axes: dict[str, int], *, ensure: bool):
    """megatron's TE wrappers' `sharded_state_dict`: the module's whole state dict (its `_extra_state` becomes a
    ShardedObject), TP-sharded along `axes`."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    if ensure:
        metadata = ensure_metadata_has_dp_cp_group(metadata)
    state_dict = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, axes, sharded_offsets, tp_group=module._tp_group,
                                               dp_cp_group=metadata["dp_cp_group"])


def _tp_group(tp_group, is_expert: bool):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)


def _condition(config, init_method):
    return init_method if config.perform_initialization else (lambda weight: None)


class TELayerNormColumnParallelLinear(LayerNormLinear):
    """megatron's wrapper of te.pytorch.LayerNormLinear (column parallel, the norm fused in front)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1):
        if gather_output or is_expert or skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers support none of gather_output, is_expert, "
                             "skip_weight_param_allocation")
        self.config = config
        self._tp_group = _tp_group(tp_group, is_expert)
        self.te_return_bias = skip_bias_add and bias
        self.stride = stride
        super().__init__(input_size, output_size, eps=config.layernorm_epsilon,
                         sequence_parallel=config.sequence_parallel, tp_group=self._tp_group,
                         tp_size=config.tensor_model_parallel_size, bias=bias, return_bias=self.te_return_bias,
                         parallel_mode="column", normalization=config.normalization,
                         zero_centered_gamma=config.layernorm_zero_centered_gamma, params_dtype=config.params_dtype,
                         init_method=_condition(config, init_method))
        self.weight.partition_stride = stride
        if self.bias is not None:
            self.bias.partition_stride = stride

    def forward(self, x):
        return _wrapper_forward(self, x)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _sharded(self, prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0}, ensure=True)


class TERowParallelLinear(Linear):
    """megatron's wrapper of te.pytorch.Linear in row mode."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 tp_group=None):
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers do not support input_is_parallel = False")
        self.config = config
        self._tp_group = _tp_group(tp_group, is_expert)
        self.te_return_bias = skip_bias_add and bias
        super().__init__(input_size, output_size, sequence_parallel=config.sequence_parallel,
                         tp_group=self._tp_group, tp_size=config.tensor_model_parallel_size, bias=bias,
                         return_bias=self.te_return_bias, parallel_mode="row", params_dtype=config.params_dtype,
                         init_method=_condition(config, init_method))
        for param in self.parameters():
            param.allreduce = True  # megatron's TELinear: reduced over DP

    def forward(self, x):
        return _wrapper_forward(self, x)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # megatron reads metadata["dp_cp_group"] here without filling it first (the layer above has)
        return _sharded(self, prefix, sharded_offsets, metadata, {"weight": 1}, ensure=False)


class DotProductAttention(_TEBaseModule):
    """te.pytorch.DotProductAttention (a TE base module: it has extra state, and no parameters here). TE drops a
    missing `core_attention._extra_state` from a load's missing keys (checkpoints of TE before 1.6 had none,
    and megatron's sharded state dict of it holds none)."""

    def __init__(self, *, num_attention_heads: int, kv_channels: int, attention_dropout: float, attn_mask_type: str,
                 softmax_scale: float | None):
        super().__init__()
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.attention_dropout, self.attn_mask_type = attention_dropout, attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else kv_channels**-0.5

        def remove_extra_states_check(module, incompatible_keys):  # TE's own hook, as TE writes it
            for key in incompatible_keys.missing_keys:
                if "core_attention._extra_state" in key:
                    incompatible_keys.missing_keys.remove(key)

        self.register_load_state_dict_post_hook(remove_extra_states_check)

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type: str, cu_seqlens=None):
        """[s, b, heads, d] in (keys and values with their query groups' heads), [s, b, heads * d] out; packed
        records (THD: [t, heads, d], `cu_seqlens` at each record's start) in and [t, heads * d] out, each record
        attending causally to itself only (TE's padding_causal)."""
        if attn_mask_type not in ("causal", "padding_causal") or attention_mask is not None:
            raise NotImplementedError(f"TEDotProductAttention stand-in: attn_mask_type={attn_mask_type} with "
                                      f"mask={attention_mask is not None}; causal without a mask only")
        thd = cu_seqlens is not None
        if thd:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # one row of t tokens
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != q.shape[1]:  # GQA: query head i reads the key / value of its group, i // (heads / groups)
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        mask = _records_causal(cu_seqlens, length=q.shape[2]) if thd else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not thd, scale=self.softmax_scale,
                                             dropout_p=self.attention_dropout if self.training else 0.0)
        out = out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
        return out.squeeze(1) if thd else out


def _records_causal(cu_seqlens: torch.Tensor, *, length: int) -> torch.Tensor:
    """bool [length, length], True = attend: a token sees the tokens of its own record up to itself."""
    starts = torch.zeros(length, dtype=torch.long, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1].long()] = 1
    record = starts.cumsum(0)
    position = torch.arange(length, device=cu_seqlens.device)
    return (record[:, None] == record[None, :]) & (position[None, :] <= position[:, None])


class TEDotProductAttention(DotProductAttention):
    """megatron's wrapper of te.pytorch.DotProductAttention."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, num_splits: int | None = None,
                 cp_comm_type: str | None = "p2p", pg_collection=None):
        if config.context_parallel_size > 1 or config.window_size is not None or k_channels or v_channels:
            raise NotImplementedError("TEDotProductAttention stand-in: no context parallelism, sliding window or "
                                      "MLA widths")
        self.config = config
        self._tp_group = pg_collection.tp if pg_collection is not None else _tp_group(None, False)
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        super().__init__(num_attention_heads=heads, kv_channels=config.kv_channels,
                         attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
                         attn_mask_type=attn_mask_type.name, softmax_scale=softmax_scale)

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None, packed_seq_params=None,
                num_splits=None):
        if attention_bias is not None:
            raise NotImplementedError("TEDotProductAttention stand-in: no attention bias")
        cu_seqlens = None
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd" or packed_seq_params.cu_seqlens_kv is not None and not \
                    torch.equal(packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_q):
                raise NotImplementedError("TEDotProductAttention stand-in: packed records as THD self-attention only")
            padded = packed_seq_params.cu_seqlens_q_padded
            cu_seqlens = packed_seq_params.cu_seqlens_q if padded is None else padded
        return DotProductAttention.forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type.name,
                                           cu_seqlens=cu_seqlens)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's: only a learnable softmax offset is saved (never the extra state)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])


class _NormOp(torch.nn.Module):
    """te.pytorch.RMSNorm / LayerNorm (TE's operation-based norms): `weight` (+ `bias`), and as extra state the
    quantizer state pickled into a byte tensor (without fp8 an empty dict: a few bytes, not an empty tensor)."""

    def __init__(self, hidden_size: int, *, eps: float, sequence_parallel: bool, zero_centered_gamma: bool,
                 normalization: str, params_dtype: torch.dtype):
        super().__init__()
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.weight = _parameter(hidden_size, dtype=params_dtype, fill=0.0 if zero_centered_gamma else 1.0)
        self.bias = _parameter(hidden_size, dtype=params_dtype, fill=0.0) if normalization == "LayerNorm" else None
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps({})), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is not None and state.numel() and pickle.loads(state.numpy().tobytes()):
            raise NotImplementedError("TENorm stand-in: fp8 extra state is not reproduced")

    def forward(self, x):
        return _norm(x, weight=self.weight, bias=self.bias, normalization=self.normalization, eps=self.eps,
                     zero_centered_gamma=self.zero_centered_gamma)


class TENorm:
    """megatron's TENorm: a factory of TE's norm of the config's kind."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise Exception("Only LayerNorm and RMSNorm are curently supported")
        return _NormOp(hidden_size, eps=eps, sequence_parallel=config.sequence_parallel,
                       zero_centered_gamma=config.layernorm_zero_centered_gamma, normalization=config.normalization,
                       params_dtype=config.params_dtype)


def spec_provider():
    """megatron's TESpecProvider with the stand-ins (dense layers; the rest is refused by name)."""
    from megatron.core.models.backends import BackendSpecProvider

    class TESpecProvider(BackendSpecProvider):
        def linear(self):
            raise NotImplementedError("TELinear (duplicated) has no stand-in")

        def column_parallel_linear(self):
            raise NotImplementedError("TEColumnParallelLinear has no stand-in")

        def row_parallel_linear(self):
            return TERowParallelLinear

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return TENorm

        def core_attention(self):
            return TEDotProductAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            raise NotImplementedError("MoE experts have no Transformer Engine stand-in")

        def activation_func(self):
            raise NotImplementedError("TEActivationOp has no stand-in")

    return TESpecProvider


def install() -> None:
    """In this process: the backend says Transformer Engine is installed (so `training.attention: fused` and the
    verify / convert default build TE's layers through dsmt's own `layer_spec`), megatron's TE layer spec is built
    from the stand-ins, and a TE layer stack's final norm is TENorm (megatron picks it by what is importable).
    Local layers (`training.attention: local`) are untouched."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    from toolkit import backend as backends

    object.__setattr__(backends.current(), "use_transformer_engine", True)  # the cached, frozen Backend
    gpt_layer_specs.TESpecProvider = spec_provider()
    transformer_block.LayerNormImpl = TENorm
