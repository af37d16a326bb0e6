"""DeepSeek-V3 / R1, and the V3-shaped Moonlight / Kimi (HF `DeepseekV3ForCausalLM`): DeepSeek-V2's layers with
sigmoid routing over an `e_score_correction_bias` inside expert groups (deepseek.py), and multi-token-prediction
layers (`num_nextn_predict_layers`) stored after the decoder as `model.layers.<num_hidden_layers + i>.*`, which
HF's model does not load: dsmt keeps them through conversion and export, bit for bit, and does not train them."""

from toolkit.adapters.family import ModelFamily, register
from toolkit.adapters.families.deepseek import (deepseek_fields, deepseek_problems, deepseek_weights, edit_routers,
                                                group_quirks, group_settings)
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.mla import MLA_LOW_RANK_Q_ROWS, MLA_PLAIN_Q_ROWS, edit_mla_layer_spec
from toolkit.adapters.routing import GroupLimitedTopk

# HF ranks a group by the sum of its two best (score + bias); megatron by its top (k / topk_group).
HF_GROUP_SCORE_TOPK = 2


def read_deepseek_v3_config(hf_config) -> dict:
    return deepseek_fields(hf_config) | sigmoid_routing_fields(hf_config)


def sigmoid_routing_fields(hf_config) -> dict:
    """V3's router (also GLM-4.5's, glm4_moe.py): sigmoid scores, the fixed correction bias, megatron's own group
    rule where it is HF's (`group_choice` otherwise)."""
    groups, chosen, topk = group_settings(hf_config)
    native_groups = groups > 1 and topk // chosen == HF_GROUP_SCORE_TOPK
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # the bias stays as published (HF keeps it a fixed buffer)
        moe_router_num_groups=groups if native_groups else None,
        moe_router_group_topk=chosen if native_groups else None,
    )


def check_deepseek_v3_config(hf_config) -> list[str]:
    return deepseek_problems(hf_config) + sigmoid_routing_problems(hf_config)


def sigmoid_routing_problems(hf_config) -> list[str]:
    """The weighting of the chosen sigmoid scores megatron-core cannot reproduce."""
    problems = []
    if hf_config.num_experts_per_tok > 1 and not hf_config.norm_topk_prob:
        problems.append("norm_topk_prob=false with sigmoid routing: megatron-core always renormalises the chosen "
                        "sigmoid scores (top-k > 1). Fix: none in dsmt for this checkpoint")
    if hf_config.num_experts_per_tok == 1 and hf_config.norm_topk_prob:
        problems.append("num_experts_per_tok=1 with norm_topk_prob=true: HF weighs the one expert 1.0, megatron-core "
                        "by its sigmoid score (it renormalises top-k > 1 only). Fix: none in dsmt for this checkpoint")
    return problems


def group_choice(hf_config) -> GroupLimitedTopk | None:
    """HF's group rule where megatron's differs (k / topk_group != 2)."""
    groups, chosen, topk = group_settings(hf_config)
    if groups <= 1 or topk // chosen == HF_GROUP_SCORE_TOPK:
        return None
    return GroupLimitedTopk(num_groups=groups, group_topk=chosen, group_score_topk=HF_GROUP_SCORE_TOPK,
                            masked_score=float("-inf"))


def mtp_layers(hf_config) -> tuple[str, ...]:
    """The multi-token-prediction layers' tensor names (`*`: any rest of the name)."""
    first = hf_config.num_hidden_layers
    return tuple(f"model.layers.{first + i}.*" for i in range(int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)))


DEEPSEEK_V3 = register(ModelFamily(
    model_type="deepseek_v3", hf_architecture="DeepseekV3ForCausalLM",
    weights=deepseek_weights(None, expert_bias=True, q_rows=MLA_PLAIN_Q_ROWS + MLA_LOW_RANK_Q_ROWS),
    untied_output=LM_HEAD, peft_experts="model.layers.*.mlp.experts", ignored_hf=ROTARY_BUFFERS, read_config=read_deepseek_v3_config,
    check_config=check_deepseek_v3_config, read_weights=lambda hf_config: deepseek_weights(hf_config, expert_bias=True),
    read_quirks=lambda hf_config: group_quirks(group_choice(hf_config)), edit_model=edit_routers, read_passthrough=mtp_layers,
    edit_layer_spec=edit_mla_layer_spec,  # the latent norms at HF's eps (toolkit/adapters/mla.py)
))
