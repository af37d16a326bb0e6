"""Mixtral (HF `MixtralForCausalLM`): the Mistral attention layout, and every MLP a mixture of SwiGLU experts
(`block_sparse_moe.experts.E.w1 / w3 / w2` = gate / up / down) chosen by a linear router (`block_sparse_moe.gate`),
top-k renormalised. In the table the second `*` is the global expert index (megatron's `mlp.experts.E` is dsmt's
canonical name; each EP rank builds only its own experts)."""

from toolkit.adapters.family import ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.mistral import check_mistral_config
from toolkit.adapters.families.moe import moe_fields, moe_problems
from toolkit.adapters.transforms import Kind

M = WeightMapping
ATTENTION_AND_NORMS = tuple(row for row in LLAMA_WEIGHTS if ".mlp." not in row.megatron)
MIXTRAL_WEIGHTS = ATTENTION_AND_NORMS + (
    M("decoder.layers.*.mlp.linear_fc1.layer_norm_weight", Kind.REPLICATED,
      ("model.layers.*.post_attention_layernorm.weight",)),
    M("decoder.layers.*.mlp.router.weight", Kind.REPLICATED, ("model.layers.*.block_sparse_moe.gate.weight",)),
    M("decoder.layers.*.mlp.experts.*.linear_fc1.weight", Kind.GATE_UP,
      ("model.layers.*.block_sparse_moe.experts.*.w1.weight", "model.layers.*.block_sparse_moe.experts.*.w3.weight")),
    M("decoder.layers.*.mlp.experts.*.linear_fc2.weight", Kind.ROW,
      ("model.layers.*.block_sparse_moe.experts.*.w2.weight",)),
)


def read_mixtral_config(hf_config) -> dict:
    return moe_fields(hf_config, num_experts=hf_config.num_local_experts, ffn_hidden_size=hf_config.intermediate_size,
                      renormalise=True)


def check_mixtral_config(hf_config) -> list[str]:
    return check_mistral_config(hf_config) + moe_problems(hf_config, renormalise=True)


MIXTRAL = register(ModelFamily(
    model_type="mixtral", hf_architecture="MixtralForCausalLM", weights=MIXTRAL_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, read_config=read_mixtral_config, check_config=check_mixtral_config,
))
