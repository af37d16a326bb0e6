"""Mixture-of-experts (Mixtral, Qwen-MoE, DeepSeek) in the planner: expert weights per rank, routed FLOPs, all-to-all
traffic. Shared experts (DeepSeek, Qwen2-MoE) are a dense MLP in every MoE layer: split over TP, replicated over EP
and partitioned with the dense parameters over dp × cp, their FLOPs on every token (no routing, no all-to-all).
Dense layers of an MoE model (DeepSeek's first_k_dense_replace) have an ordinary MLP and none of the below.

megatron-core's expert grid is etp × ep × edp × pp with the expert TP size etp = tp (toolkit/parallel/layout.py): the
num_experts experts of a layer are split over ep ranks (E / ep whole experts each), every expert's matrices over
the tp ranks as a dense MLP's are, and each expert is replicated over expert_dp = dp × cp / ep ranks. With h the
hidden size, f the expert width (moe_ffn_hidden_size), E experts, k of them per token (moe_topk), g = 3 for a
gated (SwiGLU) expert else 2, ab bytes per activation element, T a rank's tokens of one micro-batch:

  weights       per layer and rank: the router [E, h] (replicated over TP, a dense parameter) plus
                E / ep experts of g·h·f / tp elements; ZeRO partitions the experts' states over expert_dp, the
                rest over dp × cp (memory.py)
  FLOPs         forward per token: the router 2·h·E plus the k experts it is routed to, k · 2·g·h·f (Narayanan's
                counting, only the active experts); every EP rank computes k·T routed copies on average
  imbalance     the busiest EP rank receives r = min(router_imbalance, ep) times the mean routed copies (at ep = 1
                every rank holds all experts, so routing cannot unbalance it): its expert FLOPs and its routed
                activations are multiplied by r (Assumptions.router_imbalance)
  all-to-all    per MoE layer and micro-batch: dispatch and combine forward, the same backward (4; 6 with full
                recompute, which dispatches and combines again). Each moves T' · k · h · ab · (ep - 1) / ep bytes
                per rank, T' = T / tp under sequence parallelism (each TP rank dispatches its own slice of the
                sequence; megatron-core gathers the routed tokens over TP afterwards, not counted here). Over
                NVLink when the EP group (ep × tp consecutive ranks) fits in a node, else over the GPU's own NIC;
                nothing hides it. Counted at the mean: every rank sends its own tokens, only the receive side of
                the busiest rank is larger.
"""

from __future__ import annotations

from toolkit.errors import DsmtError
from toolkit.parallel.layout import divisors
from toolkit.plan.assumptions import Assumptions
from toolkit.models.shapes import ModelShape

ROUTER_PROB_BYTES = 4  # megatron-core's router softmax runs in fp32 (topk_softmax_with_capacity)


def _matrices_per_expert(shape: ModelShape) -> int:
    return 3 if shape.gated_mlp else 2


def require_expert_layout(*, shape: ModelShape, layout) -> None:
    """The ep values the arithmetic needs (whole experts per rank, whole expert_dp); the layout rules
    (toolkit/parallel/rules.py) say the same with their fixes, this guards callers that skip them."""
    ep, replicas = layout.ep, layout.dp * layout.cp
    if ep == 1:
        return
    valid = [e for e in divisors(replicas) if shape.num_experts % e == 0] if shape.is_moe else [1]
    if ep < 1 or ep not in valid:
        raise DsmtError(f"ep={ep} must divide num_experts={shape.num_experts} and dp×cp={layout.dp}×{layout.cp}="
                        f"{replicas}; valid ep: {', '.join(map(str, valid))}")


def expert_tensors(*, shape: ModelShape, tp: int) -> dict[str, int]:
    """One expert's parameter tensors on one TP rank, elements each (fc1 holds the gate and up halves when gated)."""
    f, fc1_rows = shape.moe_ffn_hidden_size // tp, 2 if shape.gated_mlp else 1
    found = {"expert_fc1": shape.hidden_size * f * fc1_rows, "expert_fc2": f * shape.hidden_size}
    if shape.expert_bias:  # GPT-OSS: fc1's bias split with its rows, fc2's (added after the reduce) whole
        found |= {"expert_fc1_bias": f * fc1_rows, "expert_fc2_bias": shape.hidden_size}
    return found


def local_experts(*, shape: ModelShape, ep: int) -> int:
    """Whole experts per layer on one EP rank (the layout rules refuse an ep that does not divide them)."""
    return shape.num_experts // ep


def expert_params_per_layer_per_gpu(*, shape: ModelShape, tp: int, ep: int) -> int:
    """The experts' weights of one layer held by one rank: E / ep experts, each split over tp ranks."""
    if not shape.is_moe:
        return 0
    return local_experts(shape=shape, ep=ep) * sum(expert_tensors(shape=shape, tp=tp).values())


def shared_expert_tensors(*, shape: ModelShape, tp: int) -> dict[str, int]:
    """An MoE layer's shared experts on one TP rank: megatron's SharedExpertMLP, a dense MLP at the shared width
    (DeepSeek: n_shared_experts × moe_intermediate_size in one MLP), and Qwen2-MoE's gate [1, h], replicated."""
    if not shape.shared_expert_ffn_hidden_size:
        return {}
    f, h = shape.shared_expert_ffn_hidden_size // tp, shape.hidden_size
    found = {"shared_fc1": h * f * (2 if shape.gated_mlp else 1), "shared_fc2": f * h}
    return found | ({"shared_gate": h} if shape.shared_expert_gate else {})


def routed_expert_params(shape: ModelShape) -> int:
    """The expert weights one token passes through in one layer: its k experts' matrices."""
    return shape.moe_topk * _matrices_per_expert(shape) * shape.hidden_size * shape.moe_ffn_hidden_size


def busiest_rank_factor(*, ep: int, assumptions: Assumptions) -> float:
    """Routed copies the busiest EP rank receives over the mean: router_imbalance, at most ep (all the tokens)."""
    return min(assumptions.router_imbalance, float(ep))


def routed_activation_bytes(*, shape: ModelShape, ep: int, mlp_bytes_per_copy: int, assumptions: Assumptions) -> float:
    """Per token of the TP group, what the experts of the busiest EP rank keep: k routed copies (times the
    imbalance), each the experts' input (ab·h) and the MLP tensors at the expert width (`mlp_bytes_per_copy`)."""
    per_copy = assumptions.activation_bytes * shape.hidden_size + mlp_bytes_per_copy
    return busiest_rank_factor(ep=ep, assumptions=assumptions) * shape.moe_topk * per_copy


def router_activation_bytes(shape: ModelShape) -> int:
    """Per token the router keeps its fp32 probabilities over the E experts."""
    return ROUTER_PROB_BYTES * shape.num_experts


def imbalance_extra_flops(*, shape: ModelShape, tokens: int, passes: float, ep: int,
                          assumptions: Assumptions) -> float:
    """FLOPs the busiest EP rank runs beyond the mean over one layer's passes (0 for a dense model)."""
    if not shape.is_moe:
        return 0.0
    excess = busiest_rank_factor(ep=ep, assumptions=assumptions) - 1.0
    return excess * 2.0 * tokens * routed_expert_params(shape) * passes


def all_to_all_bytes(*, shape: ModelShape, tokens: int, tp: int, ep: int, sequence_parallel: bool,
                     assumptions: Assumptions) -> float:
    """Bytes one rank sends to the other EP ranks in one dispatch (or combine) of one MoE layer."""
    if not shape.is_moe or ep <= 1:
        return 0.0
    dispatched = tokens // (tp if sequence_parallel else 1)
    return dispatched * shape.moe_topk * shape.hidden_size * assumptions.activation_bytes * (ep - 1) / ep


def ep_group_inside_node(*, tp: int, ep: int, gpus_per_node: int) -> bool:
    """The EP group is ep ranks tp apart (tp fastest): ep × tp consecutive ranks, inside one node when they fit."""
    return tp * ep <= gpus_per_node


def all_to_all_s(*, shape: ModelShape, layout, tokens: int, layers: int, cluster,
                 assumptions: Assumptions) -> float:
    """Exposed all-to-all time of one micro-batch through `layers` MoE layers on one rank (module docstring)."""
    one_bytes = all_to_all_bytes(shape=shape, tokens=tokens, tp=layout.tp, ep=layout.ep,
                                 sequence_parallel=layout.sp, assumptions=assumptions)
    if one_bytes <= 0:
        return 0.0
    inside = ep_group_inside_node(tp=layout.tp, ep=layout.ep, gpus_per_node=cluster.gpus_per_node)
    link_gbps = cluster.gpu.nvlink_gbps if inside else cluster.gpu.ib_gbps
    one_s = one_bytes / (link_gbps * 1e9 * assumptions.link_efficiency) + assumptions.collective_latency_s
    calls = 6 if layout.recompute == "full" else 4
    return calls * layers * one_s
