"""StarCoder2 (HF `Starcoder2ForCausalLM`): pre-norm LayerNorm with bias, biases on every linear layer (`use_bias`),
a non-gated GELU (tanh) MLP (`c_fc` / `c_proj`), RoPE, GQA, tied embeddings, and a sliding window on every layer
(`sliding_window`: megatron's `window_size` via toolkit/adapters/window.py). Dropout is kept as configured, as for
GPT-2: megatron's hidden dropout is StarCoder2's residual_dropout (after attention and after the MLP, and on the
embeddings, where StarCoder2 uses embedding_dropout, so the two must be equal), its attention dropout
attention_dropout."""

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.hf_config import rope_settings
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import sliding_window

M = WeightMapping
R = Kind.REPLICATED
L = "model.layers.*."
D = "decoder.layers.*."

STARCODER2_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("model.embed_tokens.weight",)),
    M(D + "self_attention.linear_qkv.layer_norm_weight", R, (L + "input_layernorm.weight",)),
    M(D + "self_attention.linear_qkv.layer_norm_bias", R, (L + "input_layernorm.bias",)),
    M(D + "self_attention.linear_qkv.weight", Kind.QKV,
      (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight")),
    M(D + "self_attention.linear_qkv.bias", Kind.QKV,
      (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias")),
    M(D + "self_attention.linear_proj.weight", Kind.ROW, (L + "self_attn.o_proj.weight",)),
    M(D + "self_attention.linear_proj.bias", R, (L + "self_attn.o_proj.bias",)),
    M(D + "mlp.linear_fc1.layer_norm_weight", R, (L + "post_attention_layernorm.weight",)),
    M(D + "mlp.linear_fc1.layer_norm_bias", R, (L + "post_attention_layernorm.bias",)),
    M(D + "mlp.linear_fc1.weight", Kind.COLUMN, (L + "mlp.c_fc.weight",)),
    M(D + "mlp.linear_fc1.bias", Kind.COLUMN, (L + "mlp.c_fc.bias",)),
    M(D + "mlp.linear_fc2.weight", Kind.ROW, (L + "mlp.c_proj.weight",)),
    M(D + "mlp.linear_fc2.bias", R, (L + "mlp.c_proj.bias",)),
    M("decoder.final_layernorm.weight", R, ("model.norm.weight",)),
    M("decoder.final_layernorm.bias", R, ("model.norm.bias",)),
)


def read_starcoder2_config(hf_config) -> dict:
    window = sliding_window(hf_config)
    return {"layernorm_epsilon": hf_config.norm_epsilon, "hidden_dropout": float(hf_config.residual_dropout),
            "attention_dropout": float(hf_config.attention_dropout),
            **(window.transformer_fields() if window is not None else {})}


def check_starcoder2_config(hf_config) -> list[str]:
    problems = []
    if not getattr(hf_config, "use_bias", True):
        problems.append("use_bias=False: the starcoder2 adapter reproduces the released layout with biases on every "
                        "linear layer (use_bias: true); a bias-free StarCoder2 is not supported")
    if float(hf_config.embedding_dropout) != float(hf_config.residual_dropout):
        problems.append(f"embedding_dropout={hf_config.embedding_dropout} != residual_dropout="
                        f"{hf_config.residual_dropout}: megatron applies one hidden dropout to the embeddings and the "
                        "residual branches; set them equal in config.json")
    _, _, rope_problem = rope_settings(hf_config)
    if rope_problem:
        problems.append(rope_problem)
    return problems


STARCODER2 = register(ModelFamily(
    model_type="starcoder2", hf_architecture="Starcoder2ForCausalLM", weights=STARCODER2_WEIGHTS,
    untied_output=LM_HEAD, ignored_hf=ROTARY_BUFFERS,
    architecture=Architecture(activation="gelu_tanh", gated_mlp=False, normalization="LayerNorm", linear_bias=True),
    read_config=read_starcoder2_config, check_config=check_starcoder2_config,
))
