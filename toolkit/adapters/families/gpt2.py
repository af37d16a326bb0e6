"""GPT-2 (HF `GPT2LMHeadModel`): learned absolute positions, pre-norm LayerNorm with bias, GELU (tanh
approximation, HF `gelu_new`), a non-gated MLP, biases on every linear layer, and a tied output layer.

Its linear layers are HF `Conv1D`s, which store weights [in, out] (the transpose of torch.nn.Linear): those rows are
`transposed`. q, k and v are one `c_attn` ([q ; k ; v] columns), so QKV_PACKED. Dropout is kept as configured:
megatron's hidden dropout is GPT-2's resid_pdrop (after attention, after the MLP, and on the embeddings, where
GPT-2 uses embd_pdrop, so the two must be equal) and its attention dropout is attn_pdrop."""

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.transforms import Kind

M = WeightMapping
LAYER = "transformer.h.*."

GPT2_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("transformer.wte.weight",)),
    M("embedding.position_embeddings.weight", Kind.REPLICATED, ("transformer.wpe.weight",)),
    M("decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", Kind.REPLICATED, (LAYER + "ln_1.weight",)),
    M("decoder.layers.*.self_attention.linear_qkv.layer_norm_bias", Kind.REPLICATED, (LAYER + "ln_1.bias",)),
    M("decoder.layers.*.self_attention.linear_qkv.weight", Kind.QKV_PACKED, (LAYER + "attn.c_attn.weight",),
      transposed=True),
    M("decoder.layers.*.self_attention.linear_qkv.bias", Kind.QKV_PACKED, (LAYER + "attn.c_attn.bias",)),
    M("decoder.layers.*.self_attention.linear_proj.weight", Kind.ROW, (LAYER + "attn.c_proj.weight",), transposed=True),
    M("decoder.layers.*.self_attention.linear_proj.bias", Kind.REPLICATED, (LAYER + "attn.c_proj.bias",)),
    M("decoder.layers.*.mlp.linear_fc1.layer_norm_weight", Kind.REPLICATED, (LAYER + "ln_2.weight",)),
    M("decoder.layers.*.mlp.linear_fc1.layer_norm_bias", Kind.REPLICATED, (LAYER + "ln_2.bias",)),
    M("decoder.layers.*.mlp.linear_fc1.weight", Kind.COLUMN, (LAYER + "mlp.c_fc.weight",), transposed=True),
    M("decoder.layers.*.mlp.linear_fc1.bias", Kind.COLUMN, (LAYER + "mlp.c_fc.bias",)),
    M("decoder.layers.*.mlp.linear_fc2.weight", Kind.ROW, (LAYER + "mlp.c_proj.weight",), transposed=True),
    M("decoder.layers.*.mlp.linear_fc2.bias", Kind.REPLICATED, (LAYER + "mlp.c_proj.bias",)),
    M("decoder.final_layernorm.weight", Kind.REPLICATED, ("transformer.ln_f.weight",)),
    M("decoder.final_layernorm.bias", Kind.REPLICATED, ("transformer.ln_f.bias",)),
)
LM_HEAD = M("output_layer.weight", Kind.VOCAB, ("lm_head.weight",))
# Causal-mask buffers that checkpoints saved by older transformers contain; the mask is rebuilt.
MASK_BUFFERS = (LAYER + "attn.bias", LAYER + "attn.masked_bias")


def read_gpt2_config(hf_config) -> dict:
    """GPT-2's own names for what the shared table reads (hidden size, heads, layers and positions come through
    transformers' attribute map)."""
    return {"ffn_hidden_size": hf_config.n_inner or 4 * hf_config.n_embd, "num_query_groups": hf_config.n_head,
            "layernorm_epsilon": hf_config.layer_norm_epsilon, "hidden_dropout": hf_config.resid_pdrop,
            "attention_dropout": hf_config.attn_pdrop}


def check_gpt2_config(hf_config) -> list[str]:
    problems = []
    if hf_config.embd_pdrop != hf_config.resid_pdrop:
        problems.append(f"embd_pdrop={hf_config.embd_pdrop} != resid_pdrop={hf_config.resid_pdrop}: megatron applies "
                        "one hidden dropout to the embeddings and the residual branches; set them equal")
    if not hf_config.scale_attn_weights or hf_config.scale_attn_by_inverse_layer_idx:
        problems.append(f"scale_attn_weights={hf_config.scale_attn_weights}, scale_attn_by_inverse_layer_idx="
                        f"{hf_config.scale_attn_by_inverse_layer_idx}: only the standard 1/sqrt(head_dim) attention "
                        "scale is supported (true, false)")
    return problems


GPT2 = register(ModelFamily(
    model_type="gpt2", hf_architecture="GPT2LMHeadModel", weights=GPT2_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=MASK_BUFFERS,
    architecture=Architecture(activation="gelu_tanh", gated_mlp=False, normalization="LayerNorm", linear_bias=True,
                              position_embedding="learned_absolute"),
    read_config=read_gpt2_config, hf_activation_field="activation_function", check_config=check_gpt2_config,
))
