"""Multi-latent attention (MLA, DeepSeek-V2 / V3) as megatron-core's `MLASelfAttention`: what the DeepSeek families
share for their attention — the `MLATransformerConfig` fields read from an HF config, the weight rows, and the
refusals.

HF (modeling_deepseek_v2 / v3) and megatron-core compute the same attention:
  q      = q_proj(x)                                 (q_lora_rank None: V2-Lite, Moonlight: megatron's linear_q_proj)
         | q_b_proj(rmsnorm(q_a_proj(x)))            (megatron: linear_q_up_proj(q_layernorm(linear_q_down_proj)))
  kv, kr = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])    (linear_kv_down_proj)
  k, v   = per head split(kv_b_proj(rmsnorm(kv)), [qk_nope_head_dim, v_head_dim])   (linear_kv_up_proj)
  q's and kr's rope parts are rotated with interleaved pairs (HF: V2's complex product, V3's
  `rope_interleave`; megatron's MLA de-interleaves the same way), kr shared by every head.
  scores scaled by mscale(factor, mscale_all_dim)^2 / sqrt(nope + rope) under YaRN, 1 / sqrt(nope + rope) otherwise
  (HF `yarn_apply_mscale`; megatron's `MultiLatentAttention.softmax_scale`).
HF's two latent norms (q_a_layernorm, kv_a_layernorm) are RMSNorms with transformers' fixed eps 1e-6 whatever
`rms_norm_eps` says; megatron builds them with `layernorm_epsilon`. Where the two differ (Moonlight: rms_norm_eps
1e-5) `edit_mla_layer_spec` gives the latent norms HF's eps: `HFLatentNorm` in place of the local layer's norms, and
in Transformer Engine's layer, whose LayerNormLinear takes the config's eps, the same separate norm before a plain
TE column-parallel up projection, keyed in checkpoints under the fused names as the local layer keys it.
TP splits q / kv up projections and o_proj over heads. The down projections are not per head: every TP rank holds
them whole, as Transformer Engine's duplicated `TELinear` and, in dsmt's local layers, megatron's plain `Linear`
(toolkit/adapters/layer_specs.py; megatron's local default, a column-parallel linear whose output is gathered, gives
the shared rope key a gradient of this rank's heads only). Under sequence parallelism each rank computes them on its
sequence shard and megatron sums the rope key's gradient over TP in its reduce-scatter; their weights are marked
`sequence_parallel`, so the engine sums their gradients over TP as it does the norms'. Without sequence parallelism
nothing would sum that gradient: training with TP > 1 needs sequence parallelism, which every DeepSeek model gets
from the MoE rule (`moe_tp_needs_sequence_parallel`, toolkit/parallel/rules.py).
"""

from __future__ import annotations

import dataclasses

from toolkit.adapters.family import WeightMapping
from toolkit.adapters.hf_config import rope_parameters
from toolkit.adapters.norms import TorchNorm
from toolkit.adapters.transforms import Kind

M = WeightMapping
HF_LATENT_NORM_EPS = 1e-6  # DeepseekV2RMSNorm's default, which HF's q_a_layernorm / kv_a_layernorm keep
_ATTN = "model.layers.*.self_attn"
_MEGATRON = "decoder.layers.*.self_attention"

# Shared by both q variants: the input norm (its own module in MLA layers, local and TE), the kv latent path,
# the output projection, and the MLP norm (dense layers: fused into linear_fc1; MoE layers: mapped to that name).
_COMMON = (
    M("decoder.layers.*.input_layernorm.weight", Kind.REPLICATED, ("model.layers.*.input_layernorm.weight",)),
    M(f"{_MEGATRON}.linear_kv_down_proj.weight", Kind.REPLICATED, (f"{_ATTN}.kv_a_proj_with_mqa.weight",)),
    M(f"{_MEGATRON}.linear_kv_up_proj.layer_norm_weight", Kind.REPLICATED, (f"{_ATTN}.kv_a_layernorm.weight",)),
    M(f"{_MEGATRON}.linear_kv_up_proj.weight", Kind.COLUMN, (f"{_ATTN}.kv_b_proj.weight",)),
    M(f"{_MEGATRON}.linear_proj.weight", Kind.ROW, (f"{_ATTN}.o_proj.weight",)),
    M("decoder.layers.*.mlp.linear_fc1.layer_norm_weight", Kind.REPLICATED,
      ("model.layers.*.post_attention_layernorm.weight",)),
)
_PLAIN_Q = (M(f"{_MEGATRON}.linear_q_proj.weight", Kind.COLUMN, (f"{_ATTN}.q_proj.weight",)),)
_LOW_RANK_Q = (
    M(f"{_MEGATRON}.linear_q_down_proj.weight", Kind.REPLICATED, (f"{_ATTN}.q_a_proj.weight",)),
    M(f"{_MEGATRON}.linear_q_up_proj.layer_norm_weight", Kind.REPLICATED, (f"{_ATTN}.q_a_layernorm.weight",)),
    M(f"{_MEGATRON}.linear_q_up_proj.weight", Kind.COLUMN, (f"{_ATTN}.q_b_proj.weight",)),
)
MLA_LOW_RANK_Q_ROWS = _COMMON + _LOW_RANK_Q
MLA_PLAIN_Q_ROWS = _COMMON + _PLAIN_Q


def mla_rows(hf_config) -> tuple[WeightMapping, ...]:
    return MLA_PLAIN_Q_ROWS if hf_config.q_lora_rank is None else MLA_LOW_RANK_Q_ROWS


def mla_fields(hf_config) -> dict:
    """megatron's `MLATransformerConfig` fields (build.py picks that class when `multi_latent_attention` is set)."""
    rope = rope_parameters(hf_config)
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        kv_channels=hf_config.v_head_dim,  # megatron's attention output width per head is v_head_dim
        rotary_base=float(rope["rope_theta"]),
        rotary_percent=1.0,
        mscale_all_dim=0.0,
    )
    if rope["rope_type"] == "yarn":
        fields.update(
            rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),  # transformers requires it
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings")
                                                 or hf_config.max_position_embeddings),
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 1.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    else:
        fields.update(rope_type="rope", rotary_scaling_factor=1.0)
    return fields


def mla_problems(hf_config) -> list[str]:
    """What megatron's MLA cannot reproduce of this config."""
    problems = []
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in ("default", "yarn"):
        problems.append(f"rope_type {rope['rope_type']!r} with multi-latent attention: megatron-core's MLA has "
                        "default RoPE and YaRN only. Fix: none in dsmt for this checkpoint")
    if rope["rope_type"] == "yarn":
        truncate = rope.get("truncate", True)
        if truncate is False:
            problems.append("rope_parameters.truncate=false (YaRN correction range not rounded): megatron-core "
                            "rounds it. Fix: none in dsmt for this checkpoint")
        if bool(rope.get("mscale")) != bool(rope.get("mscale_all_dim")):
            problems.append(f"rope_parameters mscale={rope.get('mscale')}, mscale_all_dim={rope.get('mscale_all_dim')}:"
                            " with only one of them set transformers' YaRN uses its default attention factor, "
                            "megatron-core's the ratio of the two. Fix: none in dsmt for this checkpoint (DeepSeek's "
                            "releases set both)")
        if rope.get("attention_factor") is not None:
            problems.append(f"rope_parameters.attention_factor={rope['attention_factor']}: megatron-core's YaRN "
                            "derives the factor from mscale / mscale_all_dim. Fix: remove attention_factor from "
                            "config.json if it equals that derivation")
    if getattr(hf_config, "rope_interleave", True) is False:
        problems.append("rope_interleave=false (RoPE on the halves of the rope dims): megatron-core's MLA rotates "
                        "interleaved pairs as DeepSeek's checkpoints do. Fix: none in dsmt for this checkpoint")
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=true (biases on the MLA projections): megatron-core's MLA has none. "
                        "Fix: none in dsmt for this checkpoint")
    return problems


class HFLatentNorm:
    """The q / kv latent norm as transformers builds it (`DeepseekV3RMSNorm(kv_lora_rank)`): eps 1e-6, not the
    `eps` megatron's MLA passes (its layernorm_epsilon = rms_norm_eps). A class, as `TorchNorm`: megatron's
    `build_module` returns functions uncalled."""

    def __new__(cls, config, hidden_size: int, eps: float | None = None, **unused):
        return TorchNorm(config, hidden_size, eps=HF_LATENT_NORM_EPS)


# The separate latent norms under the names Transformer Engine's fused layer keys them (as layer_specs.py's local MLA).
_LATENT_NORM_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def edit_mla_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """`ModelFamily.edit_layer_spec` of the DeepSeek families: the latent norms at HF's eps where the model's
    rms_norm_eps differs from it (see the module docstring); megatron's own layer otherwise."""
    if float(config.layernorm_epsilon) == HF_LATENT_NORM_EPS:
        return spec
    replaced = dict(q_layernorm=HFLatentNorm, kv_layernorm=HFLatentNorm)
    if transformer_engine:  # unfused: TE's LayerNormLinear would normalise with the config's eps
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        replaced |= dict(linear_q_up_proj=TEColumnParallelLinear, linear_kv_up_proj=TEColumnParallelLinear)
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, **replaced))
    keys = {**spec.submodules.sharded_state_dict_keys_map, **_LATENT_NORM_KEYS}
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=attention, sharded_state_dict_keys_map=keys))
