"""Gemma (HF `GemmaForCausalLM`): the Llama layout with GeGLU (tanh-approximated GELU), RMSNorms that scale by
(1 + w) (megatron's zero-centred gamma), embeddings multiplied by sqrt(hidden_size), a head_dim of its own (256 in
Gemma-2B/7B), tied embeddings and, in Gemma-2B, one KV head (TP above it replicates the head: toolkit/parallel/rules.py)."""

from toolkit.adapters.family import Architecture, ModelFamily, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config

GEMMA = register(ModelFamily(
    model_type="gemma", hf_architecture="GemmaForCausalLM", weights=LLAMA_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS,
    architecture=Architecture(activation="gelu_tanh", zero_centered_norm=True, embedding_scale=True),
    check_config=check_llama_config,
))
