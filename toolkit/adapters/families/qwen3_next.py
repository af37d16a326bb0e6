"""Qwen3-Next (HF `Qwen3NextForCausalLM`): Qwen2-MoE's mixture of experts (softmax top-k routing, renormalised with
`norm_topk_prob`, one shared expert scaled by sigmoid(shared_expert_gate(x)), dense layers where `mlp_only_layers` /
`decoder_sparse_step` say so; families/qwen2_moe.py) under two kinds of token mixer named by `layer_types`:

* "linear_attention": Gated DeltaNet (a causal depthwise conv over q / k / v, then the gated delta rule, then a
  gated RMSNorm), toolkit/adapters/qwen3_next_layers.py, with the kernels of toolkit/backend/cpu_gdn.py (torch) or
  `fla` (CUDA, where installed);
* "full_attention": Qwen3's attention (q / k head norms) whose q_proj also emits a per-head gate; the output is
  multiplied by sigmoid(gate) before o_proj (megatron's `attention_output_gate`); RoPE on the first
  int(head_dim * partial_rotary_factor) dims of each head (0.25 released; megatron's `rotary_percent`).

Every Qwen3NextRMSNorm (input, post-attention, final, q / k) scales by (1 + w) with w stored zero-centred
(megatron's `layernorm_zero_centered_gamma`); the DeltaNet's gated norm is a plain one (its own module).
Which mixer a layer has is read per global layer, so a pipeline stage builds its layers' own kinds; the weight
rows of the mixers are written per layer (`read_qwen3_next_weights`). Only megatron's local layers are built:
Transformer Engine's fuse the input norm into linear_qkv, which the DeltaNet layers have no counterpart for."""

from __future__ import annotations

import dataclasses

from toolkit.adapters.family import AdapterError, Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.families.moe import (DENSE_MLP, LLAMA_WITHOUT_MLP, expert_rows, moe_fields, moe_layer_pattern,
                                           shared_expert_rows)
from toolkit.adapters.families.qwen2_moe import shared_expert_moe_problems
from toolkit.adapters.transforms import Kind
from toolkit.models.mixer_shapes import QWEN3_NEXT_LOCAL

M = WeightMapping
LINEAR, FULL = "linear_attention", "full_attention"
_MLP = "model.layers.*.mlp"
_MIXER_ROWS = ("decoder.layers.*.self_attention.linear_qkv.weight", "decoder.layers.*.self_attention.linear_proj.weight")
# Rows whatever a layer's mixer: the embedding, both norms, the MLP (dense or MoE), the final norm; the mixers' rows
# are written per layer (`mixer_rows`).
SHARED_ROWS = tuple(row for row in LLAMA_WITHOUT_MLP if row.megatron not in _MIXER_ROWS) + DENSE_MLP + expert_rows(
    router=f"{_MLP}.gate.weight", gate=f"{_MLP}.experts.*.gate_proj.weight", up=f"{_MLP}.experts.*.up_proj.weight",
    down=f"{_MLP}.experts.*.down_proj.weight", layers="moe",
) + shared_expert_rows(hf_prefix=f"{_MLP}.shared_expert") + (
    M("decoder.layers.*.mlp.shared_experts.gate_weight", Kind.REPLICATED, (f"{_MLP}.shared_expert_gate.weight",),
      layers="moe"),
)


def mixer_rows(*, layer: int, kind: str) -> tuple[WeightMapping, ...]:
    """Layer `layer`'s token-mixer rows (concrete names: which mixer a layer has depends on the config)."""
    ours, hf = f"decoder.layers.{layer}.self_attention", f"model.layers.{layer}"
    if kind == LINEAR:
        gdn = f"{hf}.linear_attn"
        return (M(f"{ours}.in_proj_qkvz.weight", Kind.COLUMN, (f"{gdn}.in_proj_qkvz.weight",)),
                M(f"{ours}.in_proj_ba.weight", Kind.COLUMN, (f"{gdn}.in_proj_ba.weight",)),
                M(f"{ours}.conv1d.weight", Kind.REPLICATED, (f"{gdn}.conv1d.weight",)),
                M(f"{ours}.A_log", Kind.COLUMN, (f"{gdn}.A_log",)),
                M(f"{ours}.dt_bias", Kind.COLUMN, (f"{gdn}.dt_bias",)),
                M(f"{ours}.norm.weight", Kind.REPLICATED, (f"{gdn}.norm.weight",)),
                M(f"{ours}.out_proj.weight", Kind.ROW, (f"{gdn}.out_proj.weight",)))
    attn = f"{hf}.self_attn"
    return (M(f"{ours}.linear_qkv.q.weight", Kind.COLUMN, (f"{attn}.q_proj.weight",)),
            M(f"{ours}.linear_qkv.k.weight", Kind.COLUMN, (f"{attn}.k_proj.weight",)),
            M(f"{ours}.linear_qkv.v.weight", Kind.COLUMN, (f"{attn}.v_proj.weight",)),
            M(f"{ours}.q_layernorm.weight", Kind.REPLICATED, (f"{attn}.q_norm.weight",)),
            M(f"{ours}.k_layernorm.weight", Kind.REPLICATED, (f"{attn}.k_norm.weight",)),
            M(f"{ours}.linear_proj.weight", Kind.ROW, (f"{attn}.o_proj.weight",)))


def read_qwen3_next_weights(hf_config) -> tuple[WeightMapping, ...]:
    rows = SHARED_ROWS
    for layer, kind in enumerate(hf_config.layer_types):
        rows += mixer_rows(layer=layer, kind=kind)
    return rows


# Every mixer row of a 1-layer model of each kind: the family's `weights` (what its table can hold at all).
QWEN3_NEXT_WEIGHTS = SHARED_ROWS + mixer_rows(layer=0, kind=LINEAR) + mixer_rows(layer=1, kind=FULL)


def read_qwen3_next_config(hf_config) -> dict:
    pattern = moe_layer_pattern(hf_config)
    fields = moe_fields(hf_config, num_experts=hf_config.num_experts, ffn_hidden_size=hf_config.moe_intermediate_size,
                        renormalise=bool(hf_config.norm_topk_prob), num_moe_layers=sum(pattern))
    return fields | dict(
        ffn_hidden_size=hf_config.intermediate_size,  # the dense layers' MLP
        moe_layer_freq=pattern,
        moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        attention_output_gate=True,
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_num_key_heads=hf_config.linear_num_key_heads,
        linear_num_value_heads=hf_config.linear_num_value_heads,
    )


def read_qwen3_next_quirks(hf_config) -> dict:
    return {"layer_types": tuple(hf_config.layer_types)}


def check_qwen3_next_config(hf_config) -> list[str]:
    problems = check_llama_config(hf_config) + shared_expert_moe_problems(
        hf_config, family="Qwen3-Next MoE", no_moe_fix="none in dsmt (the qwen3_next adapter builds MoE models: "
                                                       "every release is one)")
    unknown = sorted(set(hf_config.layer_types) - {LINEAR, FULL})
    if unknown:
        problems.append(f"layer_types {unknown}: the qwen3_next adapter knows {LINEAR!r} and {FULL!r}")
    if len(hf_config.layer_types) != hf_config.num_hidden_layers:
        problems.append(f"layer_types has {len(hf_config.layer_types)} entries for num_hidden_layers="
                        f"{hf_config.num_hidden_layers}. Fix: one entry per layer in config.json")
    num_k, num_v = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    if num_v % num_k:
        problems.append(f"linear_num_value_heads={num_v} is not a multiple of linear_num_key_heads={num_k}: each key "
                        "head serves a whole number of value heads in HF's layout. Fix: correct config.json")
    if hf_config.hidden_act != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r}: the DeltaNet's conv and gate use silu in dsmt (as "
                        "released). Fix: hidden_act: silu")
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0):
        problems.append(f"attention_dropout={hf_config.attention_dropout}: the qwen3_next adapter trains without "
                        "dropout (the releases set 0.0). Fix: attention_dropout: 0.0")
    return problems


def tp_problems(*, settings, tp_size: int) -> list[str]:
    """The TP sizes the mixers split evenly: whole key-head groups (DeltaNet) and whole KV groups (attention)."""
    fields = settings.transformer_fields
    key_heads, kv_heads = fields["linear_num_key_heads"], fields["num_query_groups"]
    valid = ", ".join(str(t) for t in range(1, key_heads + 1) if key_heads % t == 0 and kv_heads % t == 0)
    return [f"tp={tp_size} does not divide {name}={count}: each TP rank holds whole {what}; valid tp: {valid}"
            for name, count, what in (("linear_num_key_heads", key_heads, "Gated DeltaNet key-head groups"),
                                      ("num_key_value_heads", kv_heads, "KV heads of the gated attention"))
            if count % tp_size]


def edit_qwen3_next_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """The self_attention slot becomes `TokenMixer` (DeltaNet or gated attention by the layer's kind), the gated
    attention's linear_qkv HF's three projections."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from toolkit.adapters.qwen3_next_layers import GatedQkvProjection, TokenMixer

    if transformer_engine:
        raise AdapterError("qwen3_next builds megatron's local layers only (Transformer Engine's fuse the input norm "
                           "into linear_qkv, which the Gated DeltaNet layers lack): set training.attention: local")
    problems = tp_problems(settings=settings, tp_size=config.tensor_model_parallel_size)
    if problems:
        raise AdapterError("qwen3_next layout: " + "; ".join(problems))
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, linear_qkv=GatedQkvProjection))
    # The attention's submodules ride along so that the spec still reads as local layers (layer_specs.is_local_spec)
    mixer = ModuleSpec(module=TokenMixer, params={"layer_types": settings.quirks["layer_types"], "attention": attention},
                       submodules=attention.submodules)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=mixer))


QWEN3_NEXT = register(ModelFamily(
    model_type="qwen3_next", hf_architecture="Qwen3NextForCausalLM", weights=QWEN3_NEXT_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qk_norm=True, zero_centered_norm=True, local_layers_only=QWEN3_NEXT_LOCAL),
    read_config=read_qwen3_next_config, check_config=check_qwen3_next_config, read_quirks=read_qwen3_next_quirks,
    read_weights=read_qwen3_next_weights, edit_layer_spec=edit_qwen3_next_layer_spec,
    # The released checkpoints carry a multi-token-prediction module (`mtp.*`) HF does not build: kept bit-exact.
    read_passthrough=lambda hf_config: ("mtp.*",),
))
