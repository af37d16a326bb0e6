"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): Qwen3's attention (q / k head norms, free head_dim) and every MLP a mixture
of SwiGLU experts (`mlp.experts.E.gate_proj / up_proj / down_proj`, width `moe_intermediate_size`) behind a linear
router (`mlp.gate`); the top-k weights are renormalised only with `norm_topk_prob`. The second `*` is the global
expert index. Layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused: no released
Qwen3-MoE has them."""

from toolkit.adapters.family import Architecture, ModelFamily, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.families.moe import LLAMA_WITHOUT_MLP, expert_rows, moe_fields, moe_problems
from toolkit.adapters.families.qwen3 import QK_NORMS
from toolkit.adapters.window import window_fields

_EXPERT = "model.layers.*.mlp.experts.*"
QWEN3_MOE_WEIGHTS = LLAMA_WITHOUT_MLP + QK_NORMS + expert_rows(
    router="model.layers.*.mlp.gate.weight", gate=f"{_EXPERT}.gate_proj.weight", up=f"{_EXPERT}.up_proj.weight",
    down=f"{_EXPERT}.down_proj.weight")


def num_experts(hf_config) -> int:
    """`num_experts` in Hub configs; transformers 5 saves it as `num_local_experts` (its attribute_map)."""
    return getattr(hf_config, "num_experts", None) or hf_config.num_local_experts


def read_qwen3_moe_config(hf_config) -> dict:
    return moe_fields(hf_config, num_experts=num_experts(hf_config), ffn_hidden_size=hf_config.moe_intermediate_size,
                      renormalise=bool(hf_config.norm_topk_prob)) | window_fields(hf_config)


def check_qwen3_moe_config(hf_config) -> list[str]:
    problems = check_llama_config(hf_config) + moe_problems(hf_config, renormalise=bool(hf_config.norm_topk_prob))
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1)
    if dense or step != 1:
        problems.append(f"mlp_only_layers={dense}, decoder_sparse_step={step}: layers with a dense MLP among MoE "
                        "layers are not supported by dsmt's qwen3_moe adapter. Fix: none; every layer must be MoE "
                        "(mlp_only_layers: [], decoder_sparse_step: 1, as in the Qwen3-MoE releases)")
    return problems


QWEN3_MOE = register(ModelFamily(
    model_type="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM", weights=QWEN3_MOE_WEIGHTS, untied_output=LM_HEAD, peft_experts="model.layers.*.mlp.experts",
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qk_norm=True), read_config=read_qwen3_moe_config,
    check_config=check_qwen3_moe_config,
))
