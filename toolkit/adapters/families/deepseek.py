"""What DeepSeek-V2 and V3 share (HF `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`): multi-latent attention
(toolkit/adapters/mla.py), dense first layers (`first_k_dense_replace`), and MoE layers of routed experts plus
shared experts (`n_shared_experts` x `moe_intermediate_size`, one always-on SwiGLU MLP: megatron's
`SharedExpertMLP`, added to the routed output as HF adds it). Not a family itself (registers nothing).

Routing (transformers 5's `DeepseekV2TopkRouter` / `DeepseekV3TopkRouter`, scores in fp32):
  V2  softmax over all experts; top-k (`greedy`), or top-k inside the `topk_group` groups whose best expert scores
      highest (`group_limited_greedy`); weights x routed_scaling_factor, never renormalised (transformers ignores
      `norm_topk_prob`). megatron: pre-softmax top-k with `moe_router_topk_scaling_factor`; its own group rule
      ranks groups by the sum of their top (k / topk_group) scores, which is HF's max only when that is 1, so the
      group choice is HF's own (`toolkit/adapters/routing.py`) otherwise.
  V3  sigmoid scores; experts chosen by score + `e_score_correction_bias` inside the `topk_group` groups with the
      highest sum of their top-2 (score + bias); weights the chosen scores renormalised (`norm_topk_prob`) and x
      routed_scaling_factor. megatron: sigmoid with `expert_bias` (the bias, kept fixed: dsmt never runs megatron's
      aux-free bias update, as HF fine-tuning keeps the buffer), its group rule is the same when k / topk_group = 2.
Neither HF model adds a load-balancing term to the loss; neither does dsmt for them.
"""

from __future__ import annotations

from toolkit.adapters.family import WeightMapping
from toolkit.adapters.families.llama import LLAMA_WEIGHTS
from toolkit.adapters.families.moe import DENSE_MLP, expert_rows, moe_layer_pattern, shared_expert_rows
from toolkit.adapters.mla import mla_fields, mla_problems, mla_rows
from toolkit.adapters.transforms import Kind

M = WeightMapping
_LAYER = "model.layers.*.mlp"
OUTSIDE_LAYERS = tuple(row for row in LLAMA_WEIGHTS if not row.per_layer)  # embedding, final norm
ROUTED_EXPERTS = expert_rows(router=f"{_LAYER}.gate.weight", gate=f"{_LAYER}.experts.*.gate_proj.weight",
                             up=f"{_LAYER}.experts.*.up_proj.weight", down=f"{_LAYER}.experts.*.down_proj.weight",
                             layers="moe")
SHARED_EXPERTS = shared_expert_rows(hf_prefix=f"{_LAYER}.shared_experts")
EXPERT_BIAS = M("decoder.layers.*.mlp.router.expert_bias", Kind.REPLICATED, (f"{_LAYER}.gate.e_score_correction_bias",),
                layers="moe")


def deepseek_weights(hf_config, *, expert_bias: bool, q_rows: tuple[WeightMapping, ...] | None = None
                     ) -> tuple[WeightMapping, ...]:
    """The table of one DeepSeek config (the attention rows depend on `q_lora_rank`); `q_rows` instead of the
    config's attention rows gives the family's whole table (both q variants)."""
    attention = mla_rows(hf_config) if q_rows is None else tuple(dict.fromkeys(q_rows))
    return (OUTSIDE_LAYERS + attention + DENSE_MLP + ROUTED_EXPERTS + SHARED_EXPERTS
            + ((EXPERT_BIAS,) if expert_bias else ()))


def num_routed_experts(hf_config) -> int:
    """`n_routed_experts` in Hub configs (transformers 5 may also name it num_local_experts)."""
    return getattr(hf_config, "n_routed_experts", None) or hf_config.num_local_experts


def deepseek_fields(hf_config) -> dict:
    """The TransformerConfig fields both versions share: MLA, the dense / MoE layer pattern, the experts' sizes."""
    return dict(mla_fields(hf_config), **deepseek_moe_fields(hf_config))


def deepseek_moe_fields(hf_config) -> dict:
    """The MoE part of `deepseek_fields`, also read by the families with DeepSeek's MoE layers and other attention
    (GLM-4.5: glm4_moe.py)."""
    return dict(
        num_moe_experts=num_routed_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        ffn_hidden_size=hf_config.intermediate_size,  # the dense layers' MLP
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_shared_expert_intermediate_size=hf_config.n_shared_experts * hf_config.moe_intermediate_size
        if hf_config.n_shared_experts else None,
        moe_router_dtype="fp32",  # HF routes in fp32
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor)
        if float(hf_config.routed_scaling_factor) != 1.0 else None,
        moe_grouped_gemm=False,  # SequentialMLP, as for the other MoE families (toolkit/adapters/families/moe.py)
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",  # HF's DeepSeek models add no load-balancing term
        moe_aux_loss_coeff=0.0,
        moe_router_fusion=False,  # the group rule of routing.py replaces megatron's unfused top-k only
    )


def deepseek_problems(hf_config) -> list[str]:
    """What both versions refuse: MLA's own refusals, then their MoE layers'."""
    return mla_problems(hf_config) + deepseek_moe_problems(hf_config)


def deepseek_moe_problems(hf_config) -> list[str]:
    """What DeepSeek's MoE layers refuse (also for GLM-4.5's, glm4_moe.py)."""
    problems = []
    freq = getattr(hf_config, "moe_layer_freq", 1)
    if freq != 1:
        problems.append(f"moe_layer_freq={freq}: transformers' DeepSeek model puts an MoE MLP on every layer from "
                        "first_k_dense_replace on, DeepSeek's own code only on every moe_layer_freq-th; the two "
                        "disagree. Fix: none in dsmt (every published DeepSeek config has moe_layer_freq 1)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=true: DeepSeek's MLPs have no biases in megatron-core's MoE layers. Fix: none in dsmt")
    if not hf_config.n_shared_experts:
        problems.append(f"n_shared_experts={hf_config.n_shared_experts}: transformers' DeepSeek MoE layer always "
                        "builds its shared MLP. Fix: none in dsmt")
    groups, chosen, topk = group_settings(hf_config)
    if groups > 1 and num_routed_experts(hf_config) % groups:
        problems.append(f"n_group={groups} does not divide n_routed_experts={num_routed_experts(hf_config)}. "
                        "Fix: correct config.json")
    if groups > 1 and chosen * (num_routed_experts(hf_config) // groups) < topk:
        problems.append(f"topk_group={chosen} groups of {num_routed_experts(hf_config) // groups} experts hold "
                        f"fewer than num_experts_per_tok={topk}. Fix: correct config.json")
    return problems


def group_settings(hf_config) -> tuple[int, int, int]:
    """(groups, groups chosen per token, top-k); 1 group = no group limit."""
    groups = int(getattr(hf_config, "n_group", None) or 1)
    chosen = int(getattr(hf_config, "topk_group", None) or groups)
    return groups, chosen, int(hf_config.num_experts_per_tok)


def group_quirks(choice) -> dict:
    """`ModelFamily.read_quirks`' dict holding a family's `GroupLimitedTopk` (none where megatron's rule is HF's)."""
    return {"group_choice": choice} if choice is not None else {}


def edit_routers(model, *, settings) -> None:
    """`ModelFamily.edit_model`: the routers get HF's group choice where the family's `read_quirks` put one."""
    from toolkit.adapters.routing import use_group_limited_topk

    choice = settings.quirks.get("group_choice")
    if choice is not None:
        use_group_limited_topk(model, choice=choice)

