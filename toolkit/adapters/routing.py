"""HF's group-limited expert choice where megatron-core's differs (DeepSeek-V2's `group_limited_greedy`).

megatron-core ranks expert groups by the sum of each group's top (k / topk_group) scores; DeepSeek-V2 ranks them by
their best score, DeepSeek-V3 by the sum of the top 2. Where the two rules differ, each router of the model gets a
`GroupLimitedTopk` as its `router_replay`: megatron-core's top-k step (`moe_utils.topk_routing_with_score_function`,
unfused) asks it for the chosen experts and their scores, and everything around it (softmax or sigmoid, expert
bias, renormalisation, scaling factor, aux losses, dispatch) stays megatron's. It keeps no state, so recompute and
pipeline schedules see the same choice for the same scores.
"""

from __future__ import annotations

import torch


class GroupLimitedTopk:
    """Top-k inside the `group_topk` best of `num_groups` expert groups, a group ranked by the sum of its top
    `group_score_topk` scores (1: its best score, DeepSeek-V2; 2: DeepSeek-V3). Experts outside the chosen groups
    count as `masked_score` (V2: 0.0, as HF fills them; V3: -inf)."""

    def __init__(self, *, num_groups: int, group_topk: int, group_score_topk: int, masked_score: float):
        self.num_groups, self.group_topk = num_groups, group_topk
        self.group_score_topk, self.masked_score = group_score_topk, masked_score

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k scores, their expert indices) of `scores` [tokens, experts], as HF's router picks them."""
        tokens, experts = scores.shape
        grouped = scores.view(tokens, self.num_groups, experts // self.num_groups)
        group_scores = grouped.topk(self.group_score_topk, dim=-1)[0].sum(dim=-1)
        chosen = torch.topk(group_scores, k=self.group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        masked = scores.masked_fill(~expert_mask, self.masked_score)
        values, indices = torch.topk(masked, k=topk, dim=-1)
        return values, indices


def use_group_limited_topk(model: torch.nn.Module, *, choice: GroupLimitedTopk) -> int:
    """Give every megatron router in `model` HF's group choice; returns how many routers got it."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
    for router in routers:
        router.router_replay = choice
    return len(routers)
