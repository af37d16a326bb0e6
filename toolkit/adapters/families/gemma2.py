"""Gemma 2 (HF `Gemma2ForCausalLM`): Gemma's layout (GeGLU, (1 + w) RMSNorms, embeddings times sqrt(hidden_size),
tied embeddings, a head_dim of its own) with four norms per layer,

    h = x + post_attention_layernorm(attention(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

attention scores scaled by query_pre_attn_scalar ** -0.5 (megatron's `softmax_scale`) and softcapped
(`attn_logit_softcapping`), final logits softcapped (`final_logit_softcapping`), and local (sliding-window) layers
alternating with global ones (`layer_types`; toolkit/adapters/window.py). megatron's layer keeps the pre-norms
(fused into linear_qkv / linear_fc1 as for Llama); the post-norms go in its bias-dropout-add slots
(toolkit/adapters/post_norms.py), the softcaps in toolkit/adapters/softcap.py (local attention only: Transformer
Engine's attention has no softcap)."""

from __future__ import annotations

import dataclasses

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.post_norms import NormThenAdd
from toolkit.adapters.softcap import add_logits_softcap, with_attention_softcap
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import window_fields

M = WeightMapping
R = Kind.REPLICATED
L = "model.layers.*."
D = "decoder.layers.*."

GEMMA2_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("model.embed_tokens.weight",)),
    M(D + "self_attention.linear_qkv.layer_norm_weight", R, (L + "input_layernorm.weight",)),
    M(D + "self_attention.linear_qkv.weight", Kind.QKV,
      (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight")),
    M(D + "self_attention.linear_proj.weight", Kind.ROW, (L + "self_attn.o_proj.weight",)),
    M(D + "self_attn_bda.norm.weight", R, (L + "post_attention_layernorm.weight",)),
    M(D + "mlp.linear_fc1.layer_norm_weight", R, (L + "pre_feedforward_layernorm.weight",)),
    M(D + "mlp.linear_fc1.weight", Kind.GATE_UP, (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")),
    M(D + "mlp.linear_fc2.weight", Kind.ROW, (L + "mlp.down_proj.weight",)),
    M(D + "mlp_bda.norm.weight", R, (L + "post_feedforward_layernorm.weight",)),
    M("decoder.final_layernorm.weight", R, ("model.norm.weight",)),
)

GEMMA2_ARCHITECTURE = Architecture(activation="gelu_tanh", zero_centered_norm=True, embedding_scale=True)


def read_gemma2_config(hf_config) -> dict:
    return {"softmax_scale": float(hf_config.query_pre_attn_scalar) ** -0.5,
            "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
            **window_fields(hf_config)}


def read_softcaps(hf_config) -> dict:
    def cap(name):
        value = getattr(hf_config, name, None)
        return float(value) if value else None  # HF skips the softcap for None (and 0 would divide by zero)

    return {"attn_logit_softcapping": cap("attn_logit_softcapping"),
            "final_logit_softcapping": cap("final_logit_softcapping")}


def check_gemma2_config(hf_config) -> list[str]:
    problems = [p.replace("llama adapter", f"{hf_config.model_type} adapter (released Gemma sets it false)")
                for p in check_llama_config(hf_config)]
    if getattr(hf_config, "layer_types", None) is None:  # window.py would window every layer
        problems.append(f"{hf_config.model_type} config without layer_types (transformers < 4.53 does not write it): "
                        "dsmt reads which layers are local from it; upgrade transformers (pip install -U transformers)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (an embedding model's attention): dsmt trains causal "
                        "language models; set it false, or use the checkpoint with its own tools")
    return problems


def edit_gemma2_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """megatron's layer spec (local or TE) with the post-norms in the bias-dropout-add slots and, where the config
    softcaps attention scores, megatron's local attention softcapped."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = with_attention_softcap(spec, cap=settings.attention_softcap, transformer_engine=transformer_engine)
    norm_then_add = ModuleSpec(module=NormThenAdd, params={"config": config})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attn_bda=norm_then_add, mlp_bda=norm_then_add))


def edit_gemma2_model(model, *, settings) -> None:
    add_logits_softcap(model, cap=settings.quirks.get("final_logit_softcapping"))


GEMMA2 = register(ModelFamily(
    model_type="gemma2", hf_architecture="Gemma2ForCausalLM", weights=GEMMA2_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=GEMMA2_ARCHITECTURE, hf_activation_field="hidden_activation",
    read_config=read_gemma2_config, check_config=check_gemma2_config, read_quirks=read_softcaps,
    edit_layer_spec=edit_gemma2_layer_spec, edit_model=edit_gemma2_model,
))
