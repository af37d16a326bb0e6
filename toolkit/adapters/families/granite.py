"""Granite (HF `GraniteForCausalLM`): the Llama layout with four scalars megatron-core's GPTModel does not have by
name. `attention_multiplier` replaces 1/sqrt(head_dim) as the attention scale (megatron's `softmax_scale`, read by
both local and Transformer Engine attention); `embedding_multiplier` scales the embeddings, `residual_multiplier`
each attention / MLP output before its residual add, and the logits are divided by `logits_scaling`
(`Multipliers`, applied in toolkit/adapters/build.py as an embedding hook, a scaled bias-dropout-add in the layer
spec, and an output-layer hook)."""

from toolkit.adapters.family import ModelFamily, Multipliers, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config


def read_granite_config(hf_config) -> dict:
    # Granite 3 releases set attention_dropout 0.1: megatron's attention dropout is the same (on the probabilities).
    return {"softmax_scale": float(hf_config.attention_multiplier),
            "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0)}


def read_granite_multipliers(hf_config) -> Multipliers:
    return Multipliers(embedding=float(hf_config.embedding_multiplier),
                       residual=float(hf_config.residual_multiplier),
                       logits_divisor=float(hf_config.logits_scaling))


def check_granite_config(hf_config) -> list[str]:
    problems = [p.replace("llama adapter", "granite adapter (released Granite sets it false)")
                for p in check_llama_config(hf_config)]
    if float(hf_config.logits_scaling) == 0.0:
        problems.append("logits_scaling=0: HF divides the logits by it; use a non-zero value (1.0 = no scaling)")
    return problems


GRANITE = register(ModelFamily(
    model_type="granite", hf_architecture="GraniteForCausalLM", weights=LLAMA_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, read_config=read_granite_config, read_multipliers=read_granite_multipliers,
    check_config=check_granite_config,
))
