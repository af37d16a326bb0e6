"""The shape fields of DeepSeek-V2 / V3 and Qwen-MoE configs: multi-latent attention, shared experts, dense layers.

HF names (transformers 5.25's modeling_deepseek_v2 / v3 and modeling_qwen2_moe build exactly these weights):
  MLA (`kv_lora_rank` in the config)      q_proj [nh·(nope+rope), h] when q_lora_rank is None (V2-Lite), else
                                          q_a_proj [q_lora_rank, h], q_a_layernorm [q_lora_rank],
                                          q_b_proj [nh·(nope+rope), q_lora_rank];
                                          kv_a_proj_with_mqa [kv_lora_rank + rope, h], kv_a_layernorm [kv_lora_rank],
                                          kv_b_proj [nh·(nope+v), kv_lora_rank]; o_proj [h, nh·v]
  DeepSeek MoE layers                     n_routed_experts of moe_intermediate_size, a router [E, h], and
                                          shared_experts: one MLP of n_shared_experts × moe_intermediate_size;
                                          layer i is an MoE layer when i >= first_k_dense_replace (and, in
                                          DeepSeek's own code, i % moe_layer_freq == 0; transformers 5.25 ignores
                                          moe_layer_freq, 1 in every published config), else a dense MLP of
                                          intermediate_size
  Qwen2-MoE layers                        num_experts of moe_intermediate_size, a router [E, h], shared_expert of
                                          shared_expert_intermediate_size and shared_expert_gate [1, h]; layer i
                                          is an MoE layer unless i is in mlp_only_layers or (i + 1) %
                                          decoder_sparse_step != 0 (Qwen3-MoE reads the same two fields), else a
                                          dense MLP of intermediate_size; q / k / v carry biases (qkv_bias)
A field a config.json leaves out takes transformers' default for its model_type (CONFIG_DEFAULTS, checked against
the config classes by tests/plan/test_mla_plan.py).
"""

from __future__ import annotations

import dataclasses

# transformers 5.25's defaults (DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig, Qwen2MoeConfig) of the fields
# read here.
CONFIG_DEFAULTS: dict[str, dict] = {
    "deepseek_v2": {"first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536, "n_routed_experts": 64,
                    "n_shared_experts": 2, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    "deepseek_v3": {"first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "n_routed_experts": 256,
                    "n_shared_experts": 1, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 2048},
    # GLM-4.5 / 4.6 (Glm4MoeConfig): DeepSeek-V3's MoE fields with grouped-query attention (no MLA).
    "glm4_moe": {"first_k_dense_replace": 1, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 1408},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": None,
                  "qkv_bias": True},
}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class MoeConfigError(ValueError):
    """A config field the shape needs is missing or null (shapes.py turns it into a ModelShapeError)."""


@dataclasses.dataclass(frozen=True)
class MlaShape:
    """Multi-latent attention's widths (HF field names); the weights are listed in the module docstring."""

    q_lora_rank: int | None  # None: a plain q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def down_params(self, *, hidden_size: int) -> int:
        """The projections into the latents (and the shared RoPE key): not per head, so not split by heads."""
        return ((self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim) * hidden_size

    def head_params(self, *, hidden_size: int, num_heads: int) -> int:
        """The per-head projections (TP splits them over heads): q up (or q proj), kv up, o proj."""
        q_in = self.q_lora_rank or hidden_size
        return num_heads * (self.qk_head_dim * q_in + (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
                            + self.v_head_dim * hidden_size)

    def matrix_params(self, *, hidden_size: int, num_heads: int) -> int:
        return self.down_params(hidden_size=hidden_size) + self.head_params(hidden_size=hidden_size,
                                                                            num_heads=num_heads)

    def latent_norm_params(self) -> int:
        """The RMSNorms of the q latent (when there is one) and the kv latent."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank


def _get(config: dict, key: str):
    """`key` of the config, else transformers' default for its model_type (None when it has none)."""
    if key in config:
        return config[key]
    return CONFIG_DEFAULTS.get(config.get("model_type"), {}).get(key)


def _required(config: dict, key: str):
    value = _get(config, key)
    if value is None:
        raise MoeConfigError(f"config has no {key!r} (model_type {config.get('model_type')!r}); set it in "
                             "config.json")
    return value


def is_mla_config(config: dict) -> bool:
    return "kv_lora_rank" in config or config.get("model_type") in ("deepseek_v2", "deepseek_v3")


def mla_from_config(config: dict) -> MlaShape:
    return MlaShape(q_lora_rank=_get(config, "q_lora_rank") or None,
                    **{key: _required(config, key) for key in MLA_FIELDS[1:]})


def dense_layer_indices(config: dict, *, num_layers: int) -> tuple[int, ...]:
    """The layers whose MLP is dense in an MoE config (module docstring)."""
    if "first_k_dense_replace" in config or config.get("model_type") in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        first_moe, freq = _get(config, "first_k_dense_replace") or 0, config.get("moe_layer_freq") or 1
        return tuple(i for i in range(num_layers) if i < first_moe or i % freq != 0)
    step = _get(config, "decoder_sparse_step") or 1
    only_mlp = set(_get(config, "mlp_only_layers") or ())
    return tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step != 0)


def _topk(config: dict) -> int:
    """Experts per token; a family without a defaults row (Mixtral, Qwen3-MoE) defaults to 2 as before."""
    if config.get("model_type") in CONFIG_DEFAULTS:
        return _required(config, "num_experts_per_tok")
    return config.get("num_experts_per_tok") or 2


def _shared_expert_fields(config: dict) -> dict:
    if config.get("model_type") == "qwen2_moe" or "shared_expert_intermediate_size" in config:
        width = _get(config, "shared_expert_intermediate_size") or 0
        return {"shared_expert_ffn_hidden_size": width, "shared_expert_gate": width > 0}
    shared = _get(config, "n_shared_experts") or 0
    return {"shared_expert_ffn_hidden_size": shared * (_get(config, "moe_intermediate_size") or 0)}


def moe_config_fields(config: dict, *, num_layers: int) -> dict:
    """ModelShape keyword arguments of an MoE and / or MLA config (empty for a dense model with plain attention).
    Mixtral names its experts `num_local_experts` and their width `intermediate_size`; Qwen-MoE `num_experts` and
    `moe_intermediate_size`; DeepSeek `n_routed_experts`."""
    fields: dict = {}
    if is_mla_config(config):
        mla = mla_from_config(config)
        # every head has its own k and v after the up projection; transformers writes head_dim = qk_rope_head_dim
        fields.update(mla=mla, num_kv_heads=config["num_attention_heads"], head_dim=mla.v_head_dim)
    if config.get("model_type") == "qwen2_moe":
        fields["qkv_bias"] = bool(_get(config, "qkv_bias"))
    experts = (config.get("num_local_experts") or _get(config, "num_experts") or _get(config, "n_routed_experts")
               or 0)
    if not experts:
        return fields
    fields.update(num_experts=experts, moe_topk=_topk(config),
                  moe_ffn_hidden_size=_get(config, "moe_intermediate_size") or config["intermediate_size"],
                  dense_layers=dense_layer_indices(config, num_layers=num_layers), **_shared_expert_fields(config))
    return fields
