"""GLM-4.5 / 4.6 / 4.5-Air (HF `Glm4MoeForCausalLM`): DeepSeek-V3's MoE layers on grouped-query attention.

What it takes from where (transformers 5.25 modeling_glm4_moe, read line by line):
  attention   Llama's GQA (head_dim need not be hidden / heads: 128 x 96 heads on 5120 in GLM-4.5), with biases on
              q / k / v when `attention_bias` (Qwen2's fused linear_qkv.bias; o_proj has none) and, when
              `use_qk_norm`, an RMSNorm over each q / k head before RoPE (Qwen3's, megatron's q / k_layernorm).
              Both are per config, so the table (`read_weights`), the TransformerConfig (`read_config`) and the
              layer spec (`edit_layer_spec` drops the q / k norms megatron's spec adds) follow the config.
  RoPE        partial: the first int(head_dim x partial_rotary_factor) dims of each head rotate, rotate_half style
              (the two halves of that slice, not interleaved pairs), the rest pass through; inverse frequencies
              over that rotary width. This is megatron's RotaryEmbedding with `rotary_percent` and
              `rotary_interleaved=False` (`_apply_rotary_pos_emb_bshd` rotates t[..., :rot_dim]), as Phi-4-mini's:
              the shared RoPE reading (hf_config.partial_rotary) hands GPTModel its `rotary_percent`.
  MoE         DeepSeek-V3's (deepseek.py, deepseek_v3.py): router computed in fp32 (HF keeps gate.weight and the bias
              in fp32, `_keep_in_fp32_modules_strict`; megatron's parameters share one dtype, so a bf16 model
              holds gate.weight rounded to bf16, as DeepSeek-V3's, and conversion says so), sigmoid scores, experts chosen by score +
              `e_score_correction_bias` inside `topk_group` of `n_group` groups, the chosen scores renormalised
              (`norm_topk_prob`) and x `routed_scaling_factor`; a shared SwiGLU expert of n_shared_experts x
              moe_intermediate_size added to the routed output; dense MLPs on the first `first_k_dense_replace`
              layers. The same router class as DeepSeek-V3's, line for line. No load-balancing term in HF's loss.
  experts     transformers 5 holds them fused ([E, 2I, h] gate_up_proj, [E, h, I] down_proj) but saves and loads
              the published per-expert names (`experts.<e>.gate_proj.weight`, conversion_mapping's qwen2_moe
              pattern), which the table maps, as DeepSeek's.
  MTP         `num_nextn_predict_layers` multi-token-prediction layers after the decoder
              (`model.layers.<num_hidden_layers + i>.*`), which HF's model does not build: kept bit-exact through
              conversion and export, not trained, as DeepSeek-V3's.
"""

from __future__ import annotations

import dataclasses

from toolkit.adapters.family import Architecture, ModelFamily, register
from toolkit.adapters.families.deepseek import (EXPERT_BIAS, ROUTED_EXPERTS, SHARED_EXPERTS, deepseek_moe_fields,
                                                deepseek_moe_problems, edit_routers, group_quirks)
from toolkit.adapters.families.deepseek_v3 import (group_choice, mtp_layers, sigmoid_routing_fields,
                                                   sigmoid_routing_problems)
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.moe import DENSE_MLP, LLAMA_WITHOUT_MLP
from toolkit.adapters.families.qwen2 import QKV_BIAS
from toolkit.adapters.families.qwen3 import QK_NORMS
from toolkit.adapters.hf_config import partial_rotary, rope_parameters, rope_settings

# Every row any GLM-4.5 config can have; `glm4_moe_weights` picks one config's.
GLM4_MOE_WEIGHTS = (LLAMA_WITHOUT_MLP + (QKV_BIAS,) + QK_NORMS + DENSE_MLP + ROUTED_EXPERTS + SHARED_EXPERTS
                    + (EXPERT_BIAS,))


def glm4_moe_weights(hf_config) -> tuple:
    """The table of one config: q / k / v biases only with `attention_bias`, q / k norms only with `use_qk_norm`."""
    dropped = (() if hf_config.attention_bias else (QKV_BIAS,)) + (() if hf_config.use_qk_norm else QK_NORMS)
    return tuple(row for row in GLM4_MOE_WEIGHTS if row not in dropped)


def read_glm4_moe_config(hf_config) -> dict:
    return deepseek_moe_fields(hf_config) | sigmoid_routing_fields(hf_config) | dict(
        qk_layernorm=bool(hf_config.use_qk_norm),
        add_qkv_bias=bool(hf_config.attention_bias),
        # HF's dropout on the attention probabilities in training, as megatron's (0.0 in every GLM release)
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
    )


def check_glm4_moe_config(hf_config) -> list[str]:
    problems = deepseek_moe_problems(hf_config) + sigmoid_routing_problems(hf_config)
    _, _, rope_problem = rope_settings(hf_config)  # the partial rotary's width too (hf_config.partial_rotary)
    if rope_problem:
        problems.append(rope_problem)
    params = rope_parameters(hf_config)
    (percent, _, _), rope_type = partial_rotary(hf_config, params=params), params["rope_type"]
    if percent < 1.0 and rope_type != "default":
        problems.append(f"rope_type {rope_type!r} with partial_rotary_factor={percent}: dsmt's glm4_moe adapter "
                        "rotates part of each head with default RoPE only (every GLM-4.5 / 4.6 release). Fix: none "
                        "in dsmt for this checkpoint")
    return problems


def read_glm4_moe_quirks(hf_config) -> dict:
    """HF's group choice where megatron's rule differs (deepseek_v3.py)."""
    return group_quirks(group_choice(hf_config))


def edit_glm4_moe_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """Without `use_qk_norm`, the layer has no q / k norms (the family's Architecture asks megatron for them)."""
    if config.qk_layernorm:
        return spec
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, q_layernorm=None, k_layernorm=None))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


GLM4_MOE = register(ModelFamily(
    model_type="glm4_moe", hf_architecture="Glm4MoeForCausalLM", weights=GLM4_MOE_WEIGHTS, untied_output=LM_HEAD, peft_experts="model.layers.*.mlp.experts",
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qk_norm=True, qkv_bias=True),
    read_config=read_glm4_moe_config, check_config=check_glm4_moe_config, read_weights=glm4_moe_weights,
    read_quirks=read_glm4_moe_quirks, edit_layer_spec=edit_glm4_moe_layer_spec, edit_model=edit_routers,
    read_passthrough=mtp_layers,
))
