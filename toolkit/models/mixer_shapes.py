"""The shape fields of Qwen3-Next (Gated DeltaNet layers beside gated softmax attention) and Llama 4 text (chunked
local attention, interleaved MoE): how a layer mixes its tokens, and what each kind of mixer weighs and costs.

HF names (transformers 5.25's modeling_qwen3_next / modeling_llama4 build exactly these weights):
  Qwen3-Next `layer_types` ("linear_attention" / "full_attention"; without it every `full_attention_interval`-th
  layer, default 4, is full attention, as Qwen3NextConfig.__post_init__):
    Gated DeltaNet (linear_attn)   in_proj_qkvz [2·nk·dk + 2·nv·dv, h], in_proj_ba [2·nv, h], conv1d [conv, 1, K]
                                   depthwise over conv = 2·nk·dk + nv·dv channels (q, k, v; kernel
                                   linear_conv_kernel_dim), dt_bias [nv], A_log [nv], norm [dv] (an RMSNorm of each
                                   value head gated by silu(z)), out_proj [h, nv·dv]; nk / nv key / value heads of
                                   dk / dv (linear_num_key_heads, linear_key_head_dim, ...)
    full attention (self_attn)     q_proj [2·a·d, h] (query and an output gate per channel), k_proj, v_proj
                                   [g·d, h], o_proj [h, a·d], q_norm / k_norm [d]; RoPE on partial_rotary_factor of d
    MLP                            Qwen2-MoE's (moe_shapes.py): num_experts of moe_intermediate_size, a shared expert
                                   of shared_expert_intermediate_size with its gate [1, h], decoder_sparse_step /
                                   mlp_only_layers
  Llama 4 text (`llama4_text`; `llama4` reads its text_config):
    MLP      layer i is MoE when i is in `moe_layers` (default: (i + 1) % interleave_moe_layer_step == 0), else a
             dense SwiGLU of intermediate_size_mlp; an MoE layer: num_local_experts experts of intermediate_size,
             top num_experts_per_tok, a router [E, h] without bias, one shared expert of intermediate_size, no gate
    attention Llama's (no biases; its q / k norm has no weight); `layer_types` "chunked_attention" layers (the RoPE
             layers, `no_rope_layers` entry 1, when attention_chunk_size is set) attend only within blocks of
             attention_chunk_size tokens: a query sees at most min(s, chunk) keys

The attention's biases, sinks and softcap of the other families are read here too (`attention_extras`).

What a Gated DeltaNet layer costs, per token and value head (the chunked delta rule of fla's chunk kernel and
transformers' torch_chunk_gated_delta_rule, chunks of C = 64 positions, q / k repeated to the value heads):
  FLOPs    2 x the multiply-adds, per chunk: K·K^T and Q·K^T within the chunk (2·C²·dk), the two unit-triangular
           solves for the new values and the decayed keys (C²·(dv + dk) / 2), the intra-chunk attention times the
           new values (C²·dv), and three C x dk x dv products with the dk x dv state (read by the keys, by the
           queries, and its update): per token C·(2.5·dk + 1.5·dv) + 3·dk·dv, linear in s (no s x s scores); plus
           the depthwise conv (conv·K per token)
  memory   a chunk kernel keeps its inputs and recomputes the rest in backward, except the state at every chunk
           boundary: fp32 dk x dv per value head and chunk, 4·dk·dv / C bytes per token and value head
"""

from __future__ import annotations

import dataclasses

GDN_CHUNK = 64  # the chunk length of fla's chunk_gated_delta_rule and transformers' / dsmt's torch version
LINEAR, CHUNKED, ATTENTION = "linear_attention", "chunked_attention", "attention"  # the token mixers of a layer

# transformers 5.25's defaults (Qwen3NextConfig, Llama4TextConfig) of the fields read here (checked against the
# config classes by tests/plan/test_plan_next_llama4.py).
MIXER_DEFAULTS: dict[str, dict] = {
    "qwen3_next": {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "head_dim": 256,
                   "num_experts_per_tok": 10},
    "llama4_text": {"intermediate_size_mlp": 16384, "interleave_moe_layer_step": 1, "no_rope_layer_interval": 4,
                    "attention_chunk_size": 8192, "num_local_experts": 16, "num_experts_per_tok": 1},
}
# what Qwen3NextConfig defaults without a field (partial_rotary_factor is set in __post_init__, not a field)
QWEN3_NEXT_FULL_ATTENTION_INTERVAL, QWEN3_NEXT_ROTARY = 4, 0.25
# Why each family runs on megatron's local layers only in dsmt (the families' Architecture.local_layers_only, and
# the built-in shapes')
QWEN3_NEXT_LOCAL = "Qwen3-Next's Gated DeltaNet layers"
LLAMA4_LOCAL = "Llama 4's chunked attention and query temperature"


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetShape:
    """A Gated DeltaNet layer's widths (HF field names; the weights are listed in the module docstring)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """The q, k and v channels the depthwise conv runs over."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def matrix_params(self, *, hidden_size: int) -> int:
        """in_proj_qkvz, in_proj_ba and out_proj: the weights its matmuls multiply by."""
        nk, nv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        return hidden_size * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * hidden_size

    def params(self, *, hidden_size: int) -> int:
        """The matrices, the conv kernel, dt_bias and A_log (one per value head) and the gated norm's weight."""
        return (self.matrix_params(hidden_size=hidden_size) + self.conv_channels * self.conv_kernel
                + 2 * self.num_value_heads + self.value_head_dim)

    def tensors(self, *, hidden_size: int, tp: int) -> dict[str, int]:
        """One TP rank's tensors as dsmt shards them (toolkit/adapters/qwen3_next_layers.py): the projections and
        the per-head A_log / dt_bias split over whole key-head groups, the conv kernel and the norm whole."""
        nk, nv, dk, dv, h = self.num_key_heads // tp, self.num_value_heads // tp, self.key_head_dim, \
            self.value_head_dim, hidden_size
        return {"in_proj_qkvz": h * (2 * nk * dk + 2 * nv * dv), "in_proj_ba": h * 2 * nv,
                "conv1d": self.conv_channels * self.conv_kernel, "A_log": nv, "dt_bias": nv, "gdn_norm": dv,
                "out_proj": nv * dv * h}

    def core_flops_per_token(self) -> float:
        """The chunked delta rule and the depthwise conv, forward, per token (module docstring)."""
        dk, dv, c = self.key_head_dim, self.value_head_dim, GDN_CHUNK
        per_head = c * (2.5 * dk + 1.5 * dv) + 3 * dk * dv
        return 2.0 * (self.num_value_heads * per_head + self.conv_channels * self.conv_kernel)

    def activation_bytes_per_token(self, *, tp: int, activation_bytes: int) -> int:
        """What one TP rank keeps for backward per token: the projections' outputs (q, k, v as the conv's input,
        its output and the silu's output: the chunk kernel's inputs; z), b and a (and g, beta in fp32), the core
        output and the gated norm's silu(z) and output (out_proj's input), and the fp32 state at each chunk
        boundary (module docstring). The gated norm's fp32 statistics are per head, left out."""
        nv, ab = self.num_value_heads // tp, activation_bytes
        conv, values = self.conv_channels // tp, nv * self.value_head_dim
        states = 4 * nv * self.key_head_dim * self.value_head_dim // GDN_CHUNK
        return ab * (3 * conv + 4 * values + 2 * nv) + 4 * 2 * nv + states

    def elementwise_elements_per_token(self, *, tp: int) -> int:
        """Memory-bound elements moved per token: the conv and its silu (read and write the conv channels each), the
        gated norm (read the core output and z, write its output)."""
        return (4 * self.conv_channels + 3 * self.num_value_heads * self.value_head_dim) // tp


def _get(config: dict, key: str):
    if key in config:
        return config[key]
    return MIXER_DEFAULTS.get(config.get("model_type"), {}).get(key)


def rotary_fraction(config: dict) -> float:
    """partial_rotary_factor: in rope_parameters (transformers 5) or at the top (older config.json); Qwen3-Next's
    default 0.25 where neither says."""
    rope = config.get("rope_parameters") or {}
    found = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    found = found if found is not None else config.get("partial_rotary_factor")
    if found is None:
        found = QWEN3_NEXT_ROTARY if config.get("model_type") == "qwen3_next" else 1.0
    return float(found)


def _qwen3_next_fields(config: dict, *, num_layers: int) -> dict:
    types = config.get("layer_types")
    if not types:
        interval = config.get("full_attention_interval") or QWEN3_NEXT_FULL_ATTENTION_INTERVAL
        types = [LINEAR if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    gdn = GatedDeltaNetShape(num_key_heads=_get(config, "linear_num_key_heads"),
                             num_value_heads=_get(config, "linear_num_value_heads"),
                             key_head_dim=_get(config, "linear_key_head_dim"),
                             value_head_dim=_get(config, "linear_value_head_dim"),
                             conv_kernel=_get(config, "linear_conv_kernel_dim"))
    return dict(linear_attention=gdn, linear_attention_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
                gated_query=True, qk_norm=True, head_dim=_get(config, "head_dim"),
                # the gated attention's k / v are column-split with no replication (qwen3_next_layers.py): tp divides
                # the KV heads
                kv_heads_replicable=False,
                moe_topk=_get(config, "num_experts_per_tok"))


def llama4_moe_layers(config: dict, *, num_layers: int) -> tuple[int, ...]:
    """Llama 4's MoE layers: `moe_layers` where given, else every interleave_moe_layer_step-th from step - 1."""
    if config.get("moe_layers") is not None:
        return tuple(config["moe_layers"])
    step = _get(config, "interleave_moe_layer_step") or 1
    return tuple(range(step - 1, num_layers, step))


def _llama4_chunked_layers(config: dict, *, num_layers: int) -> tuple[int, ...]:
    """The layers of `layer_types` "chunked_attention"; without it, the RoPE layers (no_rope_layers entry 1, by
    default all but every no_rope_layer_interval-th) when attention_chunk_size is set (Llama4TextConfig)."""
    if not _get(config, "attention_chunk_size"):
        return ()
    if config.get("layer_types"):
        return tuple(i for i, t in enumerate(config["layer_types"]) if t == CHUNKED)
    rope = config.get("no_rope_layers") or [int((i + 1) % _get(config, "no_rope_layer_interval") != 0)
                                            for i in range(num_layers)]
    return tuple(i for i in range(num_layers) if rope[i])


def _llama4_fields(config: dict, *, num_layers: int) -> dict:
    experts = _get(config, "num_local_experts")
    moe = set(llama4_moe_layers(config, num_layers=num_layers)) if experts else set()
    return dict(ffn_hidden_size=_get(config, "intermediate_size_mlp"), num_experts=experts,
                moe_topk=_get(config, "num_experts_per_tok"), moe_ffn_hidden_size=config["intermediate_size"],
                shared_expert_ffn_hidden_size=config["intermediate_size"], shared_expert_gate=False,
                dense_layers=tuple(i for i in range(num_layers) if i not in moe),
                attention_chunk_size=_get(config, "attention_chunk_size"),
                chunked_attention_layers=_llama4_chunked_layers(config, num_layers=num_layers))


def llama4_text_fields(config: dict) -> dict:
    """A `llama4` (Llama4ForConditionalGeneration) config.json's language model fields, where nothing read it
    through the multimodal wrapper (toolkit/adapters/multimodal.py `text_model_fields`) first: its text_config with
    the outer tie flag; any other config as it is."""
    if config.get("model_type") != "llama4" or "num_hidden_layers" in config or "text_config" not in config:
        return config
    text = dict(config["text_config"] or {})
    text.setdefault("model_type", "llama4_text")
    return {**text, "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}


def attention_extras(config: dict, *, qkv_bias: bool) -> dict:
    """The attention's biases and sinks. `attention_bias` puts biases on q / k / v (Seed-OSS, GLM-4.5, GPT-OSS) and
    on the output projection too where the family's code does (GPT-OSS; Seed-OSS when `attention_out_bias`; GLM-4.5
    never); GPT-OSS adds a sink logit per head and biases on its router and experts."""
    model_type = config.get("model_type")
    # the config's own field decides where it has one (Seed-OSS and GLM-4.5 may turn the biases off), else the family
    attention_bias = bool(config["attention_bias"]) if "attention_bias" in config else qkv_bias
    gpt_oss = model_type == "gpt_oss"
    output_bias = attention_bias and (gpt_oss or (model_type == "seed_oss" and bool(config.get("attention_out_bias"))))
    return dict(qkv_bias=attention_bias, output_bias=output_bias, attention_sinks=gpt_oss, expert_bias=gpt_oss)


def attention_softcap(config: dict) -> float | None:
    """Gemma 2's attn_logit_softcapping (Gemma 3 configs carry the field, but transformers does not apply it)."""
    return (config.get("attn_logit_softcapping") or None) if config.get("model_type") == "gemma2" else None


def mixer_config_fields(config: dict, *, num_layers: int) -> dict:
    """ModelShape keyword arguments of the token mixers (and Llama 4's MLP layout, which its moe fields do not
    follow); empty for a model of plain attention on every layer, except a partial rotary fraction."""
    fields: dict = {}
    fraction = rotary_fraction(config)
    if fraction != 1.0:
        fields["rotary_fraction"] = fraction
    if config.get("model_type") == "qwen3_next":
        fields.update(_qwen3_next_fields(config, num_layers=num_layers))
    if config.get("model_type") == "llama4_text":
        fields.update(_llama4_fields(config, num_layers=num_layers))
    return fields
