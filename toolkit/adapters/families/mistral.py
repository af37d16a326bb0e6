"""Mistral (HF `MistralForCausalLM`): the Llama layout, with its sliding window (v0.1: 4096) as megatron-core's
`window_size` (toolkit/adapters/window.py); v0.2 and later ship without one."""

from toolkit.adapters.family import ModelFamily, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.window import window_fields

MISTRAL = register(ModelFamily(
    model_type="mistral", hf_architecture="MistralForCausalLM", weights=LLAMA_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, check_config=check_llama_config, read_config=window_fields,
))
