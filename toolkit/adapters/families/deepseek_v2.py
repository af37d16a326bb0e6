"""DeepSeek-V2 / V2-Lite / V2.5 (HF `DeepseekV2ForCausalLM`): multi-latent attention, dense first layers, MoE layers
of softmax-routed experts plus shared experts. The shared parts and the routing rules: deepseek.py."""

from toolkit.adapters.family import ModelFamily, register
from toolkit.adapters.families.deepseek import (deepseek_fields, deepseek_problems, deepseek_weights, edit_routers,
                                                group_quirks, group_settings)
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.mla import MLA_LOW_RANK_Q_ROWS, MLA_PLAIN_Q_ROWS, edit_mla_layer_spec
from toolkit.adapters.routing import GroupLimitedTopk

TOPK_METHODS = ("greedy", "group_limited_greedy")


def read_deepseek_v2_config(hf_config) -> dict:
    """Softmax over all experts, the top k kept as they are (megatron's pre-softmax mode), x routed_scaling_factor."""
    return deepseek_fields(hf_config) | dict(moe_router_score_function="softmax", moe_router_pre_softmax=True)


def check_deepseek_v2_config(hf_config) -> list[str]:
    problems = deepseek_problems(hf_config)
    method = getattr(hf_config, "topk_method", "greedy")
    if method not in TOPK_METHODS:
        problems.append(f"topk_method={method!r}: DeepSeek-V2 routes with {' or '.join(TOPK_METHODS)}. "
                        "Fix: correct config.json")
    if getattr(hf_config, "norm_topk_prob", False):
        problems.append("norm_topk_prob=true: transformers' DeepseekV2 ignores it (weights x routed_scaling_factor, "
                        "never renormalised) while DeepSeek's own code renormalises; the two disagree. Fix: set "
                        "norm_topk_prob: false in config.json if the model was trained without renormalising")
    return problems


def group_choice(hf_config) -> GroupLimitedTopk | None:
    """HF's group rule for `group_limited_greedy` (groups ranked by their best score, others scored 0)."""
    if getattr(hf_config, "topk_method", "greedy") != "group_limited_greedy":
        return None
    groups, chosen, _ = group_settings(hf_config)
    if groups <= 1:
        return None
    return GroupLimitedTopk(num_groups=groups, group_topk=chosen, group_score_topk=1, masked_score=0.0)


DEEPSEEK_V2 = register(ModelFamily(
    model_type="deepseek_v2", hf_architecture="DeepseekV2ForCausalLM",
    weights=deepseek_weights(None, expert_bias=False, q_rows=MLA_PLAIN_Q_ROWS + MLA_LOW_RANK_Q_ROWS),
    untied_output=LM_HEAD, peft_experts="model.layers.*.mlp.experts", ignored_hf=ROTARY_BUFFERS, read_config=read_deepseek_v2_config,
    check_config=check_deepseek_v2_config, read_weights=lambda hf_config: deepseek_weights(hf_config, expert_bias=False),
    read_quirks=lambda hf_config: group_quirks(group_choice(hf_config)), edit_model=edit_routers,
    edit_layer_spec=edit_mla_layer_spec,  # the latent norms at HF's eps (toolkit/adapters/mla.py)
))
