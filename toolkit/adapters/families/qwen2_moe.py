"""Qwen1.5-MoE / Qwen2-MoE (HF `Qwen2MoeForCausalLM`): Qwen2's attention (q / k / v biases) and MoE layers of
softmax-routed SwiGLU experts plus one shared expert whose output HF scales by sigmoid(shared_expert_gate(x))
(megatron's `SharedExpertMLP` with `moe_shared_expert_gate`). Dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so: layer i is MoE when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
The routing and the load-balancing term are Qwen3-MoE's (families/moe.py); the term counts the MoE layers only."""

from toolkit.adapters.family import Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.moe import (DENSE_MLP, LLAMA_WITHOUT_MLP, expert_rows, moe_fields, moe_layer_pattern,
                                           moe_problems, shared_expert_rows)
from toolkit.adapters.families.qwen2 import QKV_BIAS, check_qwen2_config
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import window_fields

_MLP = "model.layers.*.mlp"
QWEN2_MOE_WEIGHTS = LLAMA_WITHOUT_MLP + (QKV_BIAS,) + DENSE_MLP + expert_rows(
    router=f"{_MLP}.gate.weight", gate=f"{_MLP}.experts.*.gate_proj.weight", up=f"{_MLP}.experts.*.up_proj.weight",
    down=f"{_MLP}.experts.*.down_proj.weight", layers="moe",
) + shared_expert_rows(hf_prefix=f"{_MLP}.shared_expert") + (
    WeightMapping("decoder.layers.*.mlp.shared_experts.gate_weight", Kind.REPLICATED,
                  (f"{_MLP}.shared_expert_gate.weight",), layers="moe"),
)


def read_qwen2_moe_config(hf_config) -> dict:
    pattern = moe_layer_pattern(hf_config)
    fields = moe_fields(hf_config, num_experts=hf_config.num_experts, ffn_hidden_size=hf_config.moe_intermediate_size,
                        renormalise=bool(hf_config.norm_topk_prob), num_moe_layers=sum(pattern))
    return fields | window_fields(hf_config) | dict(
        ffn_hidden_size=hf_config.intermediate_size,  # the dense layers' MLP
        moe_layer_freq=pattern,
        moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
    )


def check_qwen2_moe_config(hf_config) -> list[str]:
    return check_qwen2_config(hf_config) + shared_expert_moe_problems(
        hf_config, family="Qwen2-MoE", no_moe_fix="convert it as a dense qwen2 model (model_type: qwen2)")


def shared_expert_moe_problems(hf_config, *, family: str, no_moe_fix: str) -> list[str]:
    """The routing megatron reproduces, at least one MoE layer, and the shared expert every Qwen-MoE layer has
    (Qwen2-MoE, Qwen3-Next)."""
    problems = moe_problems(hf_config, renormalise=bool(hf_config.norm_topk_prob))
    if not hf_config.num_experts or not any(moe_layer_pattern(hf_config)):
        problems.append(f"num_experts={hf_config.num_experts}, mlp_only_layers={hf_config.mlp_only_layers}, "
                        f"decoder_sparse_step={hf_config.decoder_sparse_step}: no MoE layer. Fix: {no_moe_fix}")
    if not hf_config.shared_expert_intermediate_size:
        problems.append(f"shared_expert_intermediate_size=0: HF's {family} layer always has its shared expert. "
                        "Fix: correct config.json")
    return problems


QWEN2_MOE = register(ModelFamily(
    model_type="qwen2_moe", hf_architecture="Qwen2MoeForCausalLM", weights=QWEN2_MOE_WEIGHTS, untied_output=LM_HEAD, peft_experts="model.layers.*.mlp.experts",
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qkv_bias=True), read_config=read_qwen2_moe_config,
    check_config=check_qwen2_moe_config,
))
