"""ERNIE 4.5 dense (HF `Ernie4_5ForCausalLM`, ERNIE-4.5-0.3B): the Llama layer, tied embeddings, a head_dim that is not
hidden_size / heads (1024 / 16 heads x 128), optional biases on every linear layer (`use_bias`, false as released),
and RoPE on interleaved pairs rather than on halves. transformers' modeling_ernie4_5.py

    cos = cos[..., :d/2].repeat_interleave(2)              # [c0, c0, c1, c1, ...]
    rotate_half(x) = stack((-x[1::2], x[0::2]), -1).flatten(-2)   # [-x1, x0, -x3, x2, ...]

rotates the pair (x[2i], x[2i+1]) by position x inv_freq[i]: megatron-core's `rotary_interleaved` exactly (its
RotaryEmbedding lays the frequencies out as [f0, f0, f1, f1, ...] and its `_rotate_half` is the same stack), on
the local and the unfused Transformer Engine path alike. Transformer Engine's fused RoPE is not used for it
(toolkit/adapters/fusions.py): megatron-core 0.16 does not pass `rotary_interleaved` to its packed (THD) kernel,
and the unpacked one needs TE >= 2.3.

transformers also rotates in fp32 ("full precision": q.float() times fp32 cos / sin, cast back once), where megatron
rotates in the activations' dtype. `Fp32RopeSelfAttention` hands megatron's rotation fp32 queries and keys and
casts them back before the core attention, so bf16 runs round once, as HF does (fp32 runs are unchanged)."""

from __future__ import annotations

import dataclasses
import functools

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.hf_config import rope_settings
from toolkit.adapters.transforms import Kind

M = WeightMapping
L = "model.layers.*."
D = "decoder.layers.*."

# use_bias=True: a bias on each of q, k, v, o, gate, up, down (megatron's add_bias_linear).
LINEAR_BIASES = (
    M(D + "self_attention.linear_qkv.bias", Kind.QKV,
      (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias")),
    M(D + "self_attention.linear_proj.bias", Kind.REPLICATED, (L + "self_attn.o_proj.bias",)),
    M(D + "mlp.linear_fc1.bias", Kind.GATE_UP, (L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias")),
    M(D + "mlp.linear_fc2.bias", Kind.REPLICATED, (L + "mlp.down_proj.bias",)),
)


def read_ernie4_5_config(hf_config) -> dict:
    use_bias = bool(hf_config.use_bias)
    return {"rotary_interleaved": True, "add_bias_linear": use_bias, "add_qkv_bias": use_bias}


def read_ernie4_5_weights(hf_config) -> tuple[WeightMapping, ...]:
    return LLAMA_WEIGHTS + (LINEAR_BIASES if hf_config.use_bias else ())


def check_ernie4_5_config(hf_config) -> list[str]:
    # Ernie4_5Config has no attention_bias / mlp_bias (use_bias covers every linear layer): the RoPE check only.
    _, _, rope_problem = rope_settings(hf_config)
    return [rope_problem] if rope_problem else []


def _queries_keys_in_value_dtype(module, args, kwargs):
    """Forward pre-hook of the core attention: the rotated query and key back to the activations' dtype."""
    if len(args) < 3:
        return None
    query, key, value, *rest = args
    return (query.to(value.dtype), key.to(value.dtype), value, *rest), kwargs


@functools.cache
def fp32_rope_attention_class():
    """megatron's SelfAttention (local or TE submodules alike) whose RoPE runs on fp32 queries and keys."""
    from megatron.core.transformer.attention import SelfAttention

    class Fp32RopeSelfAttention(SelfAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.core_attention.register_forward_pre_hook(_queries_keys_in_value_dtype, with_kwargs=True)

        def get_query_key_value_tensors(self, *args, **kwargs):
            query, key, *rest = super().get_query_key_value_tensors(*args, **kwargs)
            return (query.float(), key.float(), *rest)

    return Fp32RopeSelfAttention


def edit_ernie4_5_layer_spec(spec, *, config, settings, transformer_engine: bool):
    attention = dataclasses.replace(spec.submodules.self_attention, module=fp32_rope_attention_class())
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


ERNIE4_5 = register(ModelFamily(
    model_type="ernie4_5", hf_architecture="Ernie4_5ForCausalLM", weights=LLAMA_WEIGHTS + LINEAR_BIASES,
    untied_output=LM_HEAD, ignored_hf=ROTARY_BUFFERS, architecture=Architecture(),
    read_config=read_ernie4_5_config, read_weights=read_ernie4_5_weights, check_config=check_ernie4_5_config,
    edit_layer_spec=edit_ernie4_5_layer_spec,
))
