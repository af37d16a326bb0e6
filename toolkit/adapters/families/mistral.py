"""Mistral (HF `MistralForCausalLM`): the Llama layout. Its sliding-window attention is not reproduced by
megatron-core's local attention, so it is refused unless the window covers every sequence (see check below)."""

from toolkit.adapters.family import ModelFamily, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config


def check_mistral_config(hf_config) -> list[str]:
    problems = check_llama_config(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        problems.append(
            f"sliding_window={window} < max_position_embeddings={hf_config.max_position_embeddings}: megatron-core's "
            "attention here is full causal attention, so sequences longer than the window would differ from HF. "
            f"Fix: set max_position_embeddings <= {window} in config.json (train with seq_length <= {window}), "
            "or sliding_window to null"
        )
    return problems


MISTRAL = register(ModelFamily(
    model_type="mistral", hf_architecture="MistralForCausalLM", weights=LLAMA_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, check_config=check_mistral_config,
))
