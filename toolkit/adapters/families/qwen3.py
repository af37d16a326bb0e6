"""Qwen3 (HF `Qwen3ForCausalLM`): the Llama layout plus an RMSNorm over each query and key head before RoPE
(megatron's qk_layernorm), and a head_dim that need not be hidden_size / heads (1024 / 16 heads x 128 in Qwen3-0.6B)."""

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import window_fields

QK_NORMS = (
    WeightMapping("decoder.layers.*.self_attention.q_layernorm.weight", Kind.REPLICATED,
                  ("model.layers.*.self_attn.q_norm.weight",)),
    WeightMapping("decoder.layers.*.self_attention.k_layernorm.weight", Kind.REPLICATED,
                  ("model.layers.*.self_attn.k_norm.weight",)),
)


QWEN3 = register(ModelFamily(
    model_type="qwen3", hf_architecture="Qwen3ForCausalLM", weights=LLAMA_WEIGHTS + QK_NORMS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qk_norm=True), check_config=check_llama_config,
    read_config=window_fields,  # use_sliding_window / max_window_layers, as Qwen2's
))
