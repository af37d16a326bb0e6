"""The layers megatron-core builds for a model: the layer spec of its attention kind (local torch layers or
Transformer Engine's), multi-latent attention's (DeepSeek), and the decoder's per-layer specs where dense and MoE
layers mix (DeepSeek's dense first layers, Qwen2-MoE's `mlp_only_layers`)."""

from __future__ import annotations

import dataclasses

from toolkit import backend as backends
from toolkit.adapters.family import AdapterError
from toolkit.adapters.norms import TorchNorm


def uses_te_layers(attention: str | None) -> bool:
    """Whether `layer_spec(attention=...)` builds Transformer Engine's layers (it refuses fused without TE)."""
    return attention == "fused" or (attention is None and backends.current().use_transformer_engine)


def layer_spec(*, attention: str | None = None, cp_size: int = 1, qk_norm: bool = False, num_experts: int = 0,
               mla: bool = False):
    """The layers for the run's attention kind (the spec's resolved `training.attention`): "fused" is Transformer
    Engine's layers (fused / flash attention; context parallelism needs them), "local" megatron's torch layers
    (unfused attention, the s x s scores stored); None (verify, convert): TE where installed, local otherwise.
    The norm kind (RMSNorm / LayerNorm, zero-centred) is read from the TransformerConfig by both. With
    `num_experts` every layer's MLP is megatron's MoELayer: a TopKRouter and a SequentialMLP of one MLP per local
    expert (megatron's grouped GEMM needs CUDA kernels; TE's grouped linear is not used either). With `mla` the
    attention is megatron's multi-latent attention, with its q and kv latent norms (toolkit/adapters/mla.py)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from toolkit.backend.megatron_fixes import define_missing_mla_te_classes, define_missing_te_names

    if num_experts:
        define_missing_te_names()  # megatron-core's router needs them on every machine without TE
    if mla:
        define_missing_mla_te_classes()  # megatron-core's MLA layer needs them on every machine without TE
    use_te = backends.current().use_transformer_engine
    if attention == "fused" and not use_te:
        raise AdapterError("training.attention=fused needs Transformer Engine, which is not importable on this "
                           f"{backends.current().name} machine; install transformer-engine where the run trains (GPU "
                           "nodes), or set training.attention: local" + (" and parallel.cp: 1" if cp_size > 1 else ""))
    if cp_size > 1 and not (use_te and attention != "local"):
        raise AdapterError(f"parallel.cp={cp_size} needs Transformer Engine's attention (ring attention over the CP "
                           "ranks); megatron's local attention has none: set parallel.cp: 1, or train with "
                           "training.attention: fused on GPUs with transformer-engine installed")
    if uses_te_layers(attention):
        # TE fuses the layer norms into its linear layers and marks their weights `sequence_parallel` itself.
        mla_kwargs = {"multi_latent_attention": True} if mla else {}
        if not num_experts:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm or mla,
                                                                              **mla_kwargs)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=qk_norm or mla, num_experts=num_experts, moe_grouped_gemm=False, **mla_kwargs)
        return with_local_checkpoint_keys(spec)
    if mla:
        return local_mla_spec(num_experts=num_experts)
    return local_layer_spec(qk_norm=qk_norm, num_experts=num_experts)


def with_local_checkpoint_keys(spec):
    """A Transformer Engine MoE layer keeps its MLP norm apart (`pre_mlp_layernorm`), where the local layers' spec
    stores it under the dense layers' fused name (`mlp.linear_fc1.layer_norm_weight`); mapping it the same way
    makes one checkpoint of an MoE model load with either kind of layers."""
    keys = {**spec.submodules.sharded_state_dict_keys_map, "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, sharded_state_dict_keys_map=keys))


def local_layer_spec(*, qk_norm: bool = False, num_experts: int = 0):
    """megatron's local (torch) layer spec with `TorchNorm` for its norms (the q / k head norms too), which, unlike
    megatron's `WrappedTorchNorm`, works with sequence parallelism and zero-centred weights."""
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm,
                                                    num_experts=num_experts or None, moe_grouped_gemm=False)
    attention = spec.submodules.self_attention
    if qk_norm:
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=TorchNorm, k_layernorm=TorchNorm))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm, self_attention=attention))


# The local MLA layer's separate norms under the names Transformer Engine's MLA layer stores them (fused into the
# linear after them); the input norm is a module of its own in both.
_LOCAL_MLA_KEYS = {
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def local_mla_spec(*, num_experts: int = 0):
    """megatron's local multi-latent attention layer with `TorchNorm` for its four norms (input, q latent, kv
    latent, MLP), keyed in checkpoints as Transformer Engine's MLA layer keys them."""
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True,
                                                    multi_latent_attention=True, num_experts=num_experts or None,
                                                    moe_grouped_gemm=False)
    attention = spec.submodules.self_attention
    whole = replicated_linear()  # the down projections, whole on every TP rank (toolkit/adapters/mla.py)
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, q_layernorm=TorchNorm, kv_layernorm=TorchNorm, core_attention=mla_core_attention(),
        linear_q_down_proj=whole, linear_kv_down_proj=whole))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm, self_attention=attention,
        sharded_state_dict_keys_map=dict(_LOCAL_MLA_KEYS)))


def replicated_linear() -> type:
    """megatron's plain local `Linear` (a torch Linear whose weight every TP rank holds whole, marked
    `sequence_parallel` as Transformer Engine's duplicated `TELinear` is), the class MLA accepts for it."""
    from megatron.core.transformer import multi_latent_attention

    from toolkit.backend.megatron_fixes import define_missing_mla_te_classes

    define_missing_mla_te_classes()
    return multi_latent_attention.Linear


def mla_core_attention() -> type:
    """megatron's local `DotProductAttention` for MLA, whose keys (nope + rope dims) and values (v_head_dim) differ
    in width. MLA passes both widths (`k_channels`, `v_channels`), which megatron-core 0.16's local attention does
    not accept; it needs neither: the scores take the key width from the tensors, and the output width per head is
    `kv_channels`, which toolkit/adapters/mla.py sets to v_head_dim (the softmax scale MLA passes is kept)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def is_local_spec(layer_spec) -> bool:
    """Whether a layer spec is megatron's local (torch) layers rather than Transformer Engine's: its core attention
    is megatron's `DotProductAttention`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = getattr(layer_spec.submodules.self_attention, "submodules", None)
    core = getattr(attention, "core_attention", None)
    if isinstance(core, ModuleSpec):  # a family's local attention with its parameters (toolkit/adapters/softcap.py)
        core = core.module
    return isinstance(core, type) and issubclass(core, DotProductAttention)


def decoder_spec(*, config, layer_spec, vp_stage: int | None):
    """What `GPTModel` builds its decoder from: the layers, and a final norm of the layers' kind.

    `layer_spec` is one spec for every layer, or a list of one per global layer (dense and MoE layers mixed): this
    stage's slice of it is built. Given one spec, megatron picks the final norm by what is installed (TENorm, else
    apex's FusedLayerNorm, else WrappedTorchNorm, which refuses sequence parallelism); local layers with `TorchNorm`
    get it as the final norm as well. Transformer Engine layers keep megatron's choice, TENorm, which handles
    sequence parallelism (and is named here for a list of TE layers)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    per_layer = isinstance(layer_spec, list)
    local = is_local_spec(layer_spec[0] if per_layer else layer_spec)
    if not per_layer and not local:
        return layer_spec
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if per_layer:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        specs = layer_spec[offset:offset + num_layers]
    else:
        specs = [layer_spec] * num_layers
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TorchNorm if local else _te_norm())


def _te_norm():
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm


def per_layer_specs(*, dense, moe, moe_layers: frozenset[int], num_layers: int):
    """One spec per global layer: `moe` for the MoE layers, `dense` for the others (or the one spec where all
    layers are alike)."""
    if len(moe_layers) in (0, num_layers):
        return moe if moe_layers else dense
    return [moe if i in moe_layers else dense for i in range(num_layers)]
