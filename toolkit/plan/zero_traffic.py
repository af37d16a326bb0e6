"""Data-parallel traffic of one step as DeepSpeed 0.19 sends it with dsmt's config, and the part hidden behind
compute.

What each ZeRO stage sends (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py), per rank,
P the parameters its stage holds, m the micro-batches per step:
  ZeRO-0   all-reduce of the gradients after the last backward                                   once per step
  ZeRO-1   bf16: BF16_Optimizer all-reduces the fp32 gradient buffer at the boundary and all-gathers the
           updated 16-bit weights after the step                                                 once per step
  ZeRO-2   every micro-batch's backward hooks all-reduce each gradient bucket
           (average_tensor -> allreduce_and_scatter: use_multi_rank_bucket_allreduce is on by default), and
           the updated weights are all-gathered after the step                               m x, then once
  ZeRO-3   every micro-batch all-gathers each module's parameters before its forward and again before its
           backward, and reduce-scatters the gradient buckets (reduce_scatter_coalesced)     3 x m per step
           A module's parameters stay gathered when the recorded module order reuses them within
           stage3_max_reuse_distance elements (partitioned_param_coordinator.py): the last layers of the
           forward, whose backward follows within 2 x (layers after them) x (parameters per layer).
Gradients travel in `communication_data_type` (dsmt: fp32, Assumptions.dp_grad_comm_bytes), parameters in
their 16-bit width. Calls: one per reduce bucket (reduce_bucket_size at ZeRO-2/3; the engine's fixed 5e8
elements at ZeRO-0/1), one per parameter group for the weight all-gather after a step, and at ZeRO-3 one per
gathered module, fewer where stage3_prefetch_bucket_size coalesces small modules into one gather; each call
pays NCCL's latency (toolkit/plan/collectives.py). With LoRA only the adapters have gradients: reductions and
the after-step gather move the trainable share, ZeRO-3's weight gathers every parameter.

The published runs the model is calibrated on (toolkit/plan/published.py) also ran megatron's distributed
optimizer (ZeRO-1 as a reduce-scatter and an all-gather per step) and PyTorch FSDP (FULL_SHARD as ZeRO-3;
SHARD_GRAD_OP gathers before forward and reduce-scatters in backward, every micro-batch): `dp_engine`.

Overlap, as dsmt's engine runs DeepSpeed: only with `overlap_comm` (which the engine sets at pp = 1 only; at
pp > 1 it reduces after the pipeline schedule) does traffic run beside compute: ZeRO-3's forward gathers beside
the forward, its backward gathers and the ZeRO-2/3 gradient reductions beside the backward (recomputed forward
included). At most `dp_overlap` of the smaller of the two is hidden (prefetch runs only a bucket ahead, and the
link is shared); boundary and after-step traffic is always exposed.
"""

from __future__ import annotations

import dataclasses
import math

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.collectives import group_ring_time_s
from toolkit.plan.layout import Cluster, PlanLayout
from toolkit.models.shapes import ModelShape

# Modules ZeRO-3 gathers per layer: megatron's attention qkv and output projections and the MLP's fc1 and fc2
# (norms sit below stage3_param_persistence_threshold and stay whole on every rank).
GATHERED_MODULES_PER_LAYER = 4
# deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE: the bucket of the engine's allreduce_gradients (ZeRO-0,
# and bf16 ZeRO-1's BF16_Optimizer), whatever the spec's reduce_bucket_size.
ENGINE_ALLREDUCE_ELEMENTS = 500_000_000
# The updated-weight all-gather after a ZeRO-1/2 step is one all_gather_into_tensor per parameter group
# (runtime/utils.py all_gather_dp_groups; allgather_bucket_size is unused on that path): dsmt's engine builds two,
# with and without weight decay (toolkit/train/engine/hybrid.py).
OPTIMIZER_PARAM_GROUPS = 2


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective of a step: `times` issues per step, each `calls` NCCL calls moving the bytes."""
    what: str
    kind: str                 # all_reduce | reduce_scatter | all_gather
    phase: str                # forward | backward | after_step
    times: int
    bytes_per_param: float
    calls: int


@dataclasses.dataclass(frozen=True)
class DpTraffic:
    forward_s: float          # ZeRO-3 gathers beside the forward passes, over the step
    backward_s: float         # gathers and gradient reductions beside the backward passes
    after_step_s: float       # boundary reductions and the weight all-gather after the step
    hidden_s: float           # the part of forward_s + backward_s hidden behind compute

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.after_step_s

    @property
    def exposed_s(self) -> float:
        return self.total_s - self.hidden_s


def overlap_share(*, layout: PlanLayout, assumptions: Assumptions) -> float:
    """Share of the hookable traffic hidden: `dp_overlap` with overlap_comm at pp = 1 and ZeRO >= 2, else none."""
    if layout.pp > 1 or layout.zero_stage <= 1 or not assumptions.overlap_comm:
        return 0.0
    return assumptions.fsdp_overlap if assumptions.dp_engine == "fsdp" else assumptions.dp_overlap


def _buckets(elements: float, bucket_elements: int) -> int:
    return max(1, math.ceil(elements / max(1, bucket_elements)))


def regathered_share(*, params: int, layers: int, assumptions: Assumptions, head_params: int = 0) -> float:
    """Share of a ZeRO-3 stage's layers gathered again before backward. Between layer i's forward and its backward
    (of L layers) DeepSpeed traverses the output layer twice (`head_params`, forward and backward) and the
    2 x (L - 1 - i) layers after it; below stage3_max_reuse_distance elements the layer stays gathered."""
    if layers <= 0 or params <= 0:
        return 1.0
    per_layer = params / layers
    budget = assumptions.zero3_max_reuse_distance - 2 * head_params
    kept = 0 if budget <= 0 else min(layers, math.ceil(budget / (2 * per_layer)))
    return 1.0 - kept / layers


def transfers(*, layout: PlanLayout, num_micro: int, params: int, modules: int, assumptions: Assumptions,
              regathered: float = 1.0, trainable: float = 1.0) -> list[Transfer]:
    """The collectives one rank's `params` (held by `modules` gathered modules) take part in over a step;
    `regathered` of them are gathered again before backward (regathered_share); `trainable` of them have
    gradients and optimizer state (LoRA: the adapters), the rest only ZeRO-3's weight gathers."""
    a, m = assumptions, num_micro
    grads, weights = a.dp_grad_comm_bytes * trainable, a.param_bytes
    reduce_calls = _buckets(params * trainable, a.reduce_bucket_elements)
    updated = Transfer("updated-weight all-gather", "all_gather", "after_step", 1, weights * trainable,
                       OPTIMIZER_PARAM_GROUPS)
    module_calls = min(modules, _buckets(params, a.zero3_prefetch_elements))
    forward_gather = Transfer("parameter all-gather before forward", "all_gather", "forward", m, weights,
                              module_calls)
    if layout.zero_stage == 3:
        backward_calls = max(1, round(module_calls * regathered)) if regathered else 0
        return [forward_gather,
                Transfer("parameter all-gather before backward", "all_gather", "backward", m,
                         weights * regathered, backward_calls),
                Transfer("gradient reduce-scatter", "reduce_scatter", "backward", m, grads, reduce_calls)]
    if a.dp_engine == "fsdp" and layout.zero_stage == 2:   # SHARD_GRAD_OP keeps the gathered weights to backward
        return [forward_gather, Transfer("gradient reduce-scatter", "reduce_scatter", "backward", m, grads,
                                         reduce_calls)]
    if layout.zero_stage == 2:
        return [Transfer("gradient all-reduce per micro-batch", "all_reduce", "backward", m, grads, reduce_calls),
                updated]
    # ZeRO-0/1: the engine's allreduce_gradients, in buckets of MEMORY_OPT_ALLREDUCE_SIZE (not the spec's)
    boundary_calls = _buckets(params * trainable, ENGINE_ALLREDUCE_ELEMENTS)
    if layout.zero_stage == 0:
        return [Transfer("gradient all-reduce", "all_reduce", "after_step", 1, grads, boundary_calls)]
    if a.dp_engine == "megatron":   # the distributed optimizer: reduce-scatter, step the shard, gather
        return [Transfer("gradient reduce-scatter", "reduce_scatter", "after_step", 1, grads, boundary_calls), updated]
    return [Transfer("gradient all-reduce", "all_reduce", "after_step", 1, grads, boundary_calls), updated]


def gathered_modules(*, shape: ModelShape, layout: PlanLayout, layers: int, moe_layers: int) -> int:
    """Modules ZeRO-3 gathers on a stage of `layers` layers: 4 per layer, an MoE layer's experts 2 per local
    expert instead of the MLP's 2, and the embedding or output layer."""
    local_experts = shape.num_experts // layout.ep if shape.is_moe else 0
    per_moe_extra = 2 * local_experts - 2 if local_experts else 0
    return GATHERED_MODULES_PER_LAYER * layers + per_moe_extra * moe_layers + 1


def dp_traffic(*, layout: PlanLayout, cluster: Cluster, num_micro: int, groups: list[tuple[int, int, int]],
               modules: int, forward_compute_s: float, backward_compute_s: float, assumptions: Assumptions,
               layers: int = 0, head_params: int = 0, trainable: float = 1.0) -> DpTraffic:
    """The step's data-parallel traffic over `groups`, each (parameters held, group size, stride of its ranks):
    the non-expert parameters over dp x cp ranks tp apart, an MoE model's experts over expert_dp ranks."""
    by_phase = {"forward": 0.0, "backward": 0.0, "after_step": 0.0}
    # the fitted latency scale: measured on DeepSpeed's ZeRO-3 runs only, so applied to ZeRO-3 only
    fitted = assumptions.dp_engine == "deepspeed" and layout.zero_stage == 3
    scale = assumptions.deepspeed_latency_scale if fitted else 1.0
    for held, size, stride in groups:
        if size <= 1 or held <= 0:
            continue
        again = (regathered_share(params=held, layers=layers, assumptions=assumptions, head_params=head_params)
                 if layers else 1.0)
        for t in transfers(layout=layout, num_micro=num_micro, params=held, modules=modules, assumptions=assumptions,
                           regathered=again, trainable=trainable):
            by_phase[t.phase] += t.times * group_ring_time_s(
                kind=t.kind, message_bytes=held * t.bytes_per_param, stride=stride, size=size, cluster=cluster,
                assumptions=assumptions, calls=t.calls, latency_scale=scale)
    share = overlap_share(layout=layout, assumptions=assumptions)
    hidden = share * (min(by_phase["forward"], forward_compute_s) + min(by_phase["backward"], backward_compute_s))
    return DpTraffic(forward_s=by_phase["forward"], backward_s=by_phase["backward"],
                     after_step_s=by_phase["after_step"], hidden_s=hidden)
