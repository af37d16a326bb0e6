"""Llama 2 / 3 (HF `LlamaForCausalLM`): RMSNorm, SwiGLU, RoPE (optionally llama3-scaled), GQA, no biases."""

from toolkit.adapters.family import ModelFamily, WeightMapping, register
from toolkit.adapters.hf_config import rope_settings
from toolkit.adapters.transforms import Kind

M = WeightMapping  # keeps the table one row per line

LLAMA_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("model.embed_tokens.weight",)),
    M("decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", Kind.REPLICATED,
      ("model.layers.*.input_layernorm.weight",)),
    M("decoder.layers.*.self_attention.linear_qkv.weight", Kind.QKV,
      ("model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
       "model.layers.*.self_attn.v_proj.weight")),
    M("decoder.layers.*.self_attention.linear_proj.weight", Kind.ROW, ("model.layers.*.self_attn.o_proj.weight",)),
    M("decoder.layers.*.mlp.linear_fc1.layer_norm_weight", Kind.REPLICATED,
      ("model.layers.*.post_attention_layernorm.weight",)),
    M("decoder.layers.*.mlp.linear_fc1.weight", Kind.GATE_UP,
      ("model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight")),
    M("decoder.layers.*.mlp.linear_fc2.weight", Kind.ROW, ("model.layers.*.mlp.down_proj.weight",)),
    M("decoder.final_layernorm.weight", Kind.REPLICATED, ("model.norm.weight",)),
)
LM_HEAD = M("output_layer.weight", Kind.VOCAB, ("lm_head.weight",))
# Old checkpoints stored the rotary cache; it is recomputed from rope_theta.
ROTARY_BUFFERS = ("model.layers.*.self_attn.rotary_emb.inv_freq",)


def check_llama_config(hf_config) -> list[str]:
    problems = []
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (biases on q/k/v/o) is not supported by the llama adapter")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True is not supported by the llama adapter")
    _, _, rope_problem = rope_settings(hf_config)
    if rope_problem:
        problems.append(rope_problem)
    return problems


LLAMA = register(ModelFamily(
    model_type="llama", hf_architecture="LlamaForCausalLM", weights=LLAMA_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, check_config=check_llama_config,
))
