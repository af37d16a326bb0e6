"""Qwen2 (HF `Qwen2ForCausalLM`): the Llama layout plus biases on q, k and v (fused into linear_qkv.bias), and
its optional sliding window on the layers from `max_window_layers` on."""

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import window_fields

QKV_BIAS = WeightMapping(
    "decoder.layers.*.self_attention.linear_qkv.bias", Kind.QKV,
    ("model.layers.*.self_attn.q_proj.bias", "model.layers.*.self_attn.k_proj.bias",
     "model.layers.*.self_attn.v_proj.bias"),
)


def check_qwen2_config(hf_config) -> list[str]:
    # Qwen2 always has q/k/v biases; `attention_bias` is not a Qwen2 field, so only the common checks apply.
    # use_sliding_window / max_window_layers: the layers from max_window_layers on attend to a window
    # (transformers' `layer_types`), reproduced by megatron's per-layer window (toolkit/adapters/window.py).
    return [p for p in check_llama_config(hf_config) if not p.startswith("attention_bias")]


QWEN2 = register(ModelFamily(
    model_type="qwen2", hf_architecture="Qwen2ForCausalLM", weights=LLAMA_WEIGHTS + (QKV_BIAS,),
    untied_output=LM_HEAD, ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qkv_bias=True),
    check_config=check_qwen2_config, read_config=window_fields,
))
