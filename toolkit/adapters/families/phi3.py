"""Phi-3 / Phi-3.5 / Phi-4-mini (HF `Phi3ForCausalLM`): the Llama computation with q, k, v stored as ONE `qkv_proj`
([q ; k ; v] rows) and gate / up as ONE `gate_up_proj` ([gate ; up] rows). Long-RoPE scaling (Phi-3 *-128k,
Phi-3.5-mini, Phi-4-mini) runs on toolkit/adapters/longrope.py. Partial rotary embeddings (Phi-4-mini:
partial_rotary_factor 0.75, 96 of 128 dims) are megatron's `rotary_percent` (toolkit/adapters/hf_config.py
`partial_rotary`): HF's phi3 `apply_rotary_pos_emb` rotates the first int(head_dim x factor) dims of each head,
rotate_half style, and passes the rest, as megatron's unfused RoPE does; with long-RoPE the attention factor then goes
on cos / sin, not on the scores (longrope.py). The sliding window (Phi-3-mini-4k: 2047) is megatron-core's
`window_size` (toolkit/adapters/window.py)."""

from toolkit.adapters.family import ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import window_fields

M = WeightMapping

PHI3_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("model.embed_tokens.weight",)),
    M("decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", Kind.REPLICATED,
      ("model.layers.*.input_layernorm.weight",)),
    M("decoder.layers.*.self_attention.linear_qkv.weight", Kind.QKV_PACKED, ("model.layers.*.self_attn.qkv_proj.weight",)),
    M("decoder.layers.*.self_attention.linear_proj.weight", Kind.ROW, ("model.layers.*.self_attn.o_proj.weight",)),
    M("decoder.layers.*.mlp.linear_fc1.layer_norm_weight", Kind.REPLICATED,
      ("model.layers.*.post_attention_layernorm.weight",)),
    M("decoder.layers.*.mlp.linear_fc1.weight", Kind.GATE_UP_PACKED, ("model.layers.*.mlp.gate_up_proj.weight",)),
    M("decoder.layers.*.mlp.linear_fc2.weight", Kind.ROW, ("model.layers.*.mlp.down_proj.weight",)),
    M("decoder.final_layernorm.weight", Kind.REPLICATED, ("model.norm.weight",)),
)


def check_phi3_config(hf_config) -> list[str]:
    problems = list(check_llama_config(hf_config))
    dropouts = {name: getattr(hf_config, name, 0.0) for name in ("resid_pdrop", "embd_pdrop", "attention_dropout")}
    if any(dropouts.values()):
        problems.append(f"dropout {dropouts}: the phi3 adapter trains without dropout (Phi-3 releases set 0.0); "
                        "set them to 0.0 in config.json")
    return problems


PHI3 = register(ModelFamily(
    model_type="phi3", hf_architecture="Phi3ForCausalLM", weights=PHI3_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, check_config=check_phi3_config, read_config=window_fields,
))
