"""Mixtral (HF `MixtralForCausalLM`): the Mistral attention layout, and every MLP a mixture of SwiGLU experts
(`block_sparse_moe.experts.E.w1 / w3 / w2` = gate / up / down) chosen by a linear router (`block_sparse_moe.gate`),
top-k renormalised. In the table the second `*` is the global expert index (megatron's `mlp.experts.E` is dsmt's
canonical name; each EP rank builds only its own experts)."""

from toolkit.adapters.family import ModelFamily, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.families.moe import LLAMA_WITHOUT_MLP, expert_rows, moe_fields, moe_problems
from toolkit.adapters.window import window_fields

_EXPERT = "model.layers.*.block_sparse_moe.experts.*"
MIXTRAL_WEIGHTS = LLAMA_WITHOUT_MLP + expert_rows(router="model.layers.*.block_sparse_moe.gate.weight",
                                                  gate=f"{_EXPERT}.w1.weight", up=f"{_EXPERT}.w3.weight",
                                                  down=f"{_EXPERT}.w2.weight")


def read_mixtral_config(hf_config) -> dict:
    return moe_fields(hf_config, num_experts=hf_config.num_local_experts, ffn_hidden_size=hf_config.intermediate_size,
                      renormalise=True) | window_fields(hf_config)


def check_mixtral_config(hf_config) -> list[str]:
    return check_llama_config(hf_config) + moe_problems(hf_config, renormalise=True)


MIXTRAL = register(ModelFamily(
    model_type="mixtral", hf_architecture="MixtralForCausalLM", weights=MIXTRAL_WEIGHTS, untied_output=LM_HEAD, peft_experts="model.layers.*.mlp.experts",
    ignored_hf=ROTARY_BUFFERS, read_config=read_mixtral_config, check_config=check_mixtral_config,
))
