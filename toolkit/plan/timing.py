"""Predicted step time of a layout: compute, tensor/context/pipeline/data-parallel communication, bubble, optimizer.

Sources
  * FLOPs: Narayanan et al. 2021 (Megatron-LM at scale), section 5.1: with full recompute
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)); here counted from the real matmul widths (GQA, SwiGLU) as
    2 FLOPs per multiply-add, 3 passes (forward, backward-data, backward-weight), +1 forward of the layers for
    full recompute, +1 forward of the attention core for selective recompute.
  * Pipeline bubble (p-1)/(v·m) (same paper, section 2.2); TP traffic 8·b·s·h·(t-1)/t elements per layer per
    micro-batch (4 all-reduces; 6 with full recompute).
  * Collectives (toolkit/plan/collectives.py): ring bounds of nccl-tests PERFORMANCE.md over the links a group
    crosses, plus NCCL's own latency per call. Ranks are megatron-core's order (tp fastest, then cp, dp, pp), one
    NIC per GPU.
  * Context parallelism (megatron-core through Transformer Engine): each rank holds s/cp tokens; per layer the
    ring passes K and V chunks cp-1 times forward and about twice that backward (K, V again and dK, dV), beside
    the attention compute. Gradients reduce over the dp x cp ranks holding equal weights.
  * Data parallel as DeepSpeed 0.19 sends it under dsmt's engine (toolkit/plan/zero_traffic.py): per stage, what
    it all-reduces, reduce-scatters and all-gathers per micro-batch or per step, in how many calls, and what
    runs beside compute (ZeRO-2/3 with overlap_comm at pp = 1 only).
  * Multi-latent attention (DeepSeek): the down and up projections' FLOPs on every token, the core QK^T over
    nope + rope dims and AV over v_head_dim. Under TP the down projections are whole on every rank (Transformer
    Engine) but each rank runs them on its own s / tp tokens (dsmt runs TP with SP for MoE), so they divide by tp
    like the rest. Not counted: the TP all-reduce of those duplicated weights' gradients (~(q_lora_rank +
    kv_lora_rank + rope)·h per layer, once per step).
  * Mixture of experts (toolkit/plan/experts.py): a token's FLOPs count the router, its top-k experts and the shared
    experts only; dense layers of an MoE model (DeepSeek's first layers) count their whole MLP; the
    busiest EP rank's expert FLOPs are router_imbalance times the mean; the token all-to-all (dispatch and
    combine, forward and backward: 4 per layer and micro-batch) is its own term, over NVLink when the EP group
    fits in a node, else over the NICs. Expert gradients reduce, and their optimizer runs, over the expert_dp
    ranks (tp × ep apart) that hold the same experts; the other parameters over dp × cp.
  * Qwen3-Next's Gated DeltaNet layers (toolkit/models/mixer_shapes.py): their projections as matmuls and the
    chunked delta rule's FLOPs, linear in s, in place of the attention core; its gated attention's q projection
    twice as wide. Llama 4's chunked attention layers score min(s, attention_chunk_size) keys per query in the
    model FLOPs and under a fused kernel; megatron's local attention (what dsmt's llama4 family runs) computes
    all s and masks, so its time counts s.
  * DPO (toolkit/plan/dpo.py): a micro-batch of pairs is one row of seq_length per pair packed, two unpacked; a
    live reference adds a forward-only pipeline pass over the step's micro-batches before the policy's, about a
    third of the policy's compute (a quarter under full recompute, whose step already runs each forward twice).
    The reference forward is work the method needs, so the model FLOPs (MFU) count it too.
"""

from __future__ import annotations

import dataclasses
import math

from toolkit.models.mixer_shapes import ATTENTION, LINEAR
from toolkit.plan.activations import heads_per_rank
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.collectives import group_ring_time_s
from toolkit.plan.dpo import live_reference, rows_per_pair
from toolkit.plan.experts import all_to_all_s, imbalance_extra_flops
from toolkit.plan.layers import (padded_vocab_size, representative_stages, stage_expert_params_per_gpu,
                                 stage_layer_kinds, stage_params_per_gpu)
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape, num_micro_batches
from toolkit.plan.memory import DEFAULT_ASSUMPTIONS
from toolkit.plan.lora import stage_lora_params
from toolkit.plan.zero_traffic import DpTraffic, dp_traffic, gathered_modules
from toolkit.models.shapes import ModelShape


@dataclasses.dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float          # matmul time of the slowest stage over the step, bubble excluded
    elementwise_s: float      # memory-bound kernels (norms, activations, softmax) of that stage over the step
    tp_comm_s: float          # exposed tensor-parallel collectives over the step
    cp_comm_s: float          # exposed context-parallel ring exchange over the step
    ep_comm_s: float          # expert-parallel token all-to-all (MoE dispatch and combine) over the step
    pp_comm_s: float          # pipeline point-to-point over the step
    bubble_s: float           # pipeline fill and drain
    dp_comm_s: float          # exposed data-parallel collectives
    dp_hidden_s: float        # data-parallel collectives hidden behind compute (ZeRO-2/3 with overlap_comm, pp = 1)
    optimizer_s: float
    bubble_fraction: float    # (p-1)/(v·m), the paper's bubble time over ideal time
    flops_per_step: float     # hardware FLOPs, recompute included
    model_flops_per_step: float   # FLOPs without recompute (the MFU numerator)
    tokens_per_s: float
    mfu: float
    dp_traffic: DpTraffic | None = None   # the data-parallel traffic by phase (zero_traffic.py)
    reference_s: float = 0.0  # DPO: the live reference's forward pass over the step's micro-batches (dpo.py)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: the MFU with the recomputed forward counted as work."""
        return self.mfu * self.flops_per_step / self.model_flops_per_step


def matmul_efficiency(*, gpu, assumptions: Assumptions) -> float:
    """Achieved / peak matmul throughput: the assumption when set (--efficiency), else the GPU's fitted value."""
    return assumptions.efficiency if assumptions.efficiency is not None else gpu.matmul_efficiency


def layer_forward_flops(*, shape: ModelShape, tokens: int, seq_length: int, moe: bool | None = None,
                        mixer: str = ATTENTION, keys: int | None = None) -> tuple[float, float]:
    """(matmul FLOPs, attention-core FLOPs) of one layer's forward over `tokens` tokens, each query attending to
    `seq_length` keys (counted in full, as Narayanan's formula does). An MoE layer's (when `moe`, default: when the
    model is MoE) token runs through the router, its top-k experts and the shared experts, not all experts; MLA's
    through its down and up projections (ModelShape.attention_matrix_params). A Gated DeltaNet layer (`mixer`
    LINEAR) runs its projections and the chunked delta rule; `keys` caps the keys per query (chunked attention)."""
    moe = shape.is_moe if moe is None else moe
    matmul_params = shape.mixer_matrix_params(mixer) + shape.active_mlp_params(moe=moe)
    if mixer == LINEAR:
        return 2.0 * tokens * matmul_params, tokens * shape.linear_attention.core_flops_per_token()
    # QK^T over the query / key width, AV over the value width (MLA: nope + rope and v_head_dim; else both d)
    keys = seq_length if keys is None else keys
    core = 2.0 * tokens * keys * shape.num_attention_heads * (shape.qk_head_dim + shape.v_head_dim)
    return 2.0 * tokens * matmul_params, core


def training_flops(*, shape: ModelShape, tokens: int, seq_length: int, recompute: str, tp: int = 1,
                   extra_forwards: int = 0) -> float:
    """Training FLOPs (forward + backward, recompute included) of the whole model over `tokens` tokens (chunked
    attention's queries scored against the keys of their chunk only), plus `extra_forwards` forwards of the whole
    model (DPO's live reference: 1)."""
    passes = (4.0 if recompute == "full" else 3.0) + extra_forwards
    layers = 0.0
    for (moe, mixer), count in shape.layer_kinds().items():
        matmul, core = layer_forward_flops(shape=shape, tokens=tokens, seq_length=seq_length, moe=moe, mixer=mixer,
                                           keys=shape.attention_keys(mixer=mixer, seq_length=seq_length))
        layers += count * ((matmul + core) * passes + (core if recompute == "selective" and mixer != LINEAR else 0.0))
    logits = 2.0 * tokens * padded_vocab_size(shape=shape, tp=tp) * shape.hidden_size
    return layers + (3.0 + extra_forwards) * logits


def estimate_step_time(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, cluster: Cluster,
                       assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> StepTime:
    """Predicted time of one optimizer step on the slowest pipeline stage."""
    a, gpu = assumptions, cluster.gpu
    m, p, v, t = num_micro_batches(layout=layout, training=training), layout.pp, layout.vpp, layout.tp
    s = training.seq_length
    mb = max((_per_micro_batch_s(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=a,
                                 stage=stage) for stage in _timed_stages(shape=shape, layout=layout)),
             key=lambda x: x.total_s)
    per_mb_s = mb.total_s
    bubble_s = (p - 1) / v * per_mb_s
    passes = 4.0 if layout.recompute == "full" else 3.0   # forward, backward (2x), a recomputed forward
    busy_s = m * (mb.compute_s + mb.elementwise_s)
    dp = _dp_traffic(shape=shape, layout=layout, cluster=cluster, num_micro=m, forward_s=busy_s / passes,
                     backward_s=busy_s * (passes - 1) / passes, assumptions=a, lora=training.lora)
    optimizer_s = _optimizer_s(shape=shape, layout=layout, cluster=cluster, assumptions=a)
    reference_s = _reference_pass_s(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=a,
                                    num_micro=m, dp=dp)
    step_s = m * per_mb_s + bubble_s + dp.exposed_s + optimizer_s + reference_s
    global_tokens = training.global_batch_size * rows_per_pair(training) * s  # DPO: pairs x their rows
    forwards = 1 if live_reference(training) else 0
    model_flops = training_flops(shape=shape, tokens=global_tokens, seq_length=s, recompute="none", tp=t,
                                 extra_forwards=forwards)
    hw_flops = training_flops(shape=shape, tokens=global_tokens, seq_length=s, recompute=layout.recompute, tp=t,
                              extra_forwards=forwards)
    return StepTime(
        step_time_s=step_s, compute_s=m * mb.compute_s, elementwise_s=m * mb.elementwise_s,
        tp_comm_s=m * mb.tp_s, cp_comm_s=m * mb.cp_s, ep_comm_s=m * mb.ep_s,
        pp_comm_s=m * mb.pp_s, bubble_s=bubble_s, dp_comm_s=dp.exposed_s, dp_hidden_s=dp.hidden_s,
        optimizer_s=optimizer_s, bubble_fraction=(p - 1) / (v * m), flops_per_step=hw_flops,
        model_flops_per_step=model_flops, tokens_per_s=global_tokens / step_s,
        mfu=model_flops / (step_s * cluster.world_size * gpu.peak_bf16_tflops * 1e12), dp_traffic=dp,
        reference_s=reference_s,
    )


def _reference_pass_s(*, shape, layout, training, cluster, assumptions, num_micro: int, dp: DpTraffic) -> float:
    """DPO's live reference: one forward of each of the step's micro-batches, a forward-only pipeline pass before
    the policy's (toolkit/plan/dpo.py), so m + (p-1)/v forwards of the slowest stage. Its forward is the forward's
    share of each term of a micro-batch without recompute: compute 1/3 (forward, backward-data, backward-weight;
    the logits too), memory-bound kernels 1 / (1 + elementwise_backward_factor), TP collectives 2 of 4, pipeline
    sends 1 of 2 (activations, not gradients), the CP ring 1 of 3 exchanges, the MoE all-to-all 2 of 4. Under
    ZeRO-3 with LoRA the reference is the partitioned policy, whose forward gathers the weights again (the step's
    forward gathers, none of them hidden)."""
    if not live_reference(training):
        return 0.0
    a, plain = assumptions, dataclasses.replace(layout, recompute="none")
    forward_s = max(_forward_share_s(_per_micro_batch_s(shape=shape, layout=plain, training=training, cluster=cluster,
                                                        assumptions=a, stage=stage), assumptions=a)
                    for stage in _timed_stages(shape=shape, layout=layout))
    gathers_s = dp.forward_s if training.lora is not None and layout.zero_stage >= 3 else 0.0
    return (num_micro + (layout.pp - 1) / layout.vpp) * forward_s + gathers_s


def _forward_share_s(mb: "_MicroBatch", *, assumptions: Assumptions) -> float:
    """The forward's part of a micro-batch timed without recompute (_reference_pass_s)."""
    return (mb.compute_s / 3 + mb.elementwise_s / (1 + assumptions.elementwise_backward_factor) + mb.tp_s / 2
            + mb.pp_s / 2 + mb.cp_s / 3 + mb.ep_s / 2)


@dataclasses.dataclass(frozen=True)
class _MicroBatch:
    compute_s: float
    elementwise_s: float
    tp_s: float
    cp_s: float
    pp_s: float
    ep_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.elementwise_s + self.tp_s + self.cp_s + self.pp_s + self.ep_s


def _timed_stages(*, shape: ModelShape, layout: PlanLayout) -> list[int]:
    """The stages that can be the slowest: the last (its layers plus the logits) when every layer is alike, else
    also the first of each other mix of layer kinds."""
    mixed = shape.dense_layers or shape.mixed_layers
    return representative_stages(shape=shape, layout=layout) if mixed else [layout.pp - 1]


def _stage_layer_kinds(*, shape: ModelShape, layout: PlanLayout, stage: int) -> dict[tuple[bool, str], int]:
    """(is MoE, token mixer) -> layers of a stage: megatron splits evenly; a published uneven split holds at most
    the ceiling."""
    if shape.dense_layers or shape.mixed_layers:
        return stage_layer_kinds(shape=shape, layout=layout, stage=stage)
    return {(shape.is_moe, shape.layer_mixer(0)): math.ceil(shape.num_layers / layout.pp)}


def _dense_and_moe(kinds: dict[tuple[bool, str], int]) -> tuple[int, int]:
    moe = sum(count for (is_moe, _), count in kinds.items() if is_moe)
    return sum(kinds.values()) - moe, moe


def _per_micro_batch_s(*, shape, layout, training, cluster, assumptions, stage: int) -> _MicroBatch:
    """One micro-batch through pipeline stage `stage` (the last adds the logits) on one rank."""
    a, t, cp = assumptions, layout.tp, layout.cp
    s = training.seq_length
    tokens = s * layout.micro_batch_size * rows_per_pair(training) // cp  # this rank's share (DPO: the pairs' rows)
    kinds = _stage_layer_kinds(shape=shape, layout=layout, stage=stage)
    dense, moe = _dense_and_moe(kinds)
    layers = dense + moe
    passes = 4.0 if layout.recompute == "full" else 3.0
    layer_flops = core_flops = elementwise = 0.0
    for (is_moe, mixer), count in kinds.items():
        # a fused kernel skips the blocks chunked attention masks; megatron's local attention computes them
        keys = shape.attention_keys(mixer=mixer, seq_length=s) if a.attention == "fused" else s
        matmul, core = layer_forward_flops(shape=shape, tokens=tokens, seq_length=s, moe=is_moe, mixer=mixer,
                                           keys=keys)
        flops = (matmul + core) * passes + (core if layout.recompute == "selective" and mixer != LINEAR else 0.0)
        if is_moe:  # the step waits on the EP rank the router sends the most tokens to
            flops += imbalance_extra_flops(shape=shape, tokens=tokens, passes=passes, ep=layout.ep, assumptions=a)
        layer_flops, core_flops = layer_flops + count * flops, core_flops + count * core
        elementwise += count * elementwise_bytes(shape=shape, layout=layout, tokens=tokens, seq_length=s,
                                                 assumptions=a, moe=is_moe, mixer=mixer)
    logits = 6.0 * tokens * padded_vocab_size(shape=shape, tp=t) * shape.hidden_size if stage == layout.pp - 1 else 0.0
    stage_flops = (layer_flops + logits) / t
    flops_per_s = cluster.gpu.peak_bf16_tflops * 1e12 * matmul_efficiency(gpu=cluster.gpu, assumptions=a)
    elementwise_s = elementwise / (cluster.gpu.hbm_gbps * 1e9)
    # Tensor parallel: 4 all-reduces (or reduce-scatter + all-gather pairs under SP, the same volume) per layer.
    tp_calls = 6 if layout.recompute == "full" else 4
    tp_one = group_ring_time_s(kind="all_reduce", message_bytes=tokens * shape.hidden_size * a.activation_bytes,
                               stride=1, size=t, cluster=cluster, assumptions=a)
    tp_s = tp_one * tp_calls * layers * (1.0 - a.tp_overlap)
    cp_s = _cp_exposed_s(shape=shape, layout=layout, tokens=tokens, layers=layers,
                         attention_s=core_flops * passes / t / flops_per_s, cluster=cluster, assumptions=a)
    ep_s = all_to_all_s(shape=shape, layout=layout, tokens=tokens, layers=moe, cluster=cluster, assumptions=a)
    return _MicroBatch(compute_s=stage_flops / flops_per_s, elementwise_s=elementwise_s, tp_s=tp_s, cp_s=cp_s,
                       pp_s=_pp_p2p_s(shape=shape, layout=layout, tokens=tokens, cluster=cluster, assumptions=a),
                       ep_s=ep_s)


def elementwise_bytes(*, shape: ModelShape, layout: PlanLayout, tokens: int, seq_length: int,
                      assumptions: Assumptions, moe: bool | None = None, mixer: str = ATTENTION) -> float:
    """HBM bytes one rank's memory-bound kernels move in one layer for `tokens` tokens (forward, backward and any
    recomputed forward), counted in bf16 elements per token of the forward:
      hidden width h (split by SP): two norms (read h, write h), two residual adds (read 2h, write h), with
        dropout two dropouts (read h, write h and a 1-byte mask)              -> 10h, +5h with dropout
      FFN width f (split by TP): activation read f write f (GeLU), SwiGLU reads 2f  -> 2f or 3f
        (an MoE layer: the k routed copies at the expert width and the shared experts,
        f = k · moe_ffn_hidden_size + shared width, at the mean routing)
      MLA's latents (split by SP): their norms (read and write q_lora_rank and kv_lora_rank)
      attention scores a·s (split by TP), only without fused attention: softmax read and write, with dropout
        also its mask and output                                             -> 2as, +2.5as with dropout
      a Gated DeltaNet layer (mixer LINEAR) has no scores: its conv, silu and gated norm instead (split by TP)
    """
    a, h, t = assumptions, shape.hidden_size, layout.tp
    hidden = (10 + (5 if a.dropout else 0)) * h / (t if layout.sp else 1)
    moe = shape.is_moe if moe is None else moe
    if shape.mla:
        hidden += 2 * ((shape.mla.q_lora_rank or 0) + shape.mla.kv_lora_rank) / (t if layout.sp else 1)
    ffn_width = (shape.moe_topk * shape.moe_ffn_hidden_size + shape.shared_expert_ffn_hidden_size if moe
                 else shape.ffn_hidden_size)
    ffn = (3 if shape.gated_mlp else 2) * ffn_width / t
    scores = 0.0
    if mixer == LINEAR:
        scores = shape.linear_attention.elementwise_elements_per_token(tp=t)
    elif a.attention == "local":  # unfused attention writes the s x s scores to memory (fused / flash does not)
        scores = (2 + (2.5 if a.dropout else 0)) * shape.num_attention_heads * seq_length / t
    forward = (hidden + ffn + scores) * tokens * a.activation_bytes
    selective = 0.0 if mixer == LINEAR else scores * tokens * a.activation_bytes  # re-runs softmax attention only
    recomputed = {"full": forward, "selective": selective}.get(layout.recompute, 0.0)
    return forward * (1 + a.elementwise_backward_factor) + recomputed


def _cp_exposed_s(*, shape, layout, tokens, layers, attention_s, cluster, assumptions) -> float:
    """Ring attention: cp-1 K/V chunk exchanges per layer forward, ~2x that backward, `cp_overlap` of it hidden
    behind the attention compute of the stage (never more than that compute)."""
    cp, a = layout.cp, assumptions
    if cp <= 1:
        return 0.0
    _, kv_heads = heads_per_rank(shape=shape, tp=layout.tp)  # a replicated KV head when tp > num_kv_heads
    kv_chunk_bytes = tokens * kv_heads * (shape.qk_head_dim + shape.v_head_dim) * a.activation_bytes
    # point-to-point to the ring neighbour: NVLink inside a node, else the GPU's own NIC (no striping over others)
    inside = layout.tp * cp <= cluster.gpus_per_node
    link = cluster.gpu.nvlink_gbps if inside else cluster.gpu.ib_gbps
    per_exchange = kv_chunk_bytes / (link * 1e9 * a.link_efficiency) + a.collective_latency_s
    total = 3 * (cp - 1) * per_exchange * layers
    return total - a.cp_overlap * min(total, attention_s)


def _pp_p2p_s(*, shape, layout, tokens, cluster, assumptions) -> float:
    """Each of the v chunks sends activations forward and gradients backward per micro-batch. Some stage
    boundary crosses nodes unless the whole job sits in one node."""
    if layout.pp <= 1:
        return 0.0
    a = assumptions
    p2p_bytes = tokens * shape.hidden_size * a.activation_bytes / (layout.tp if layout.sp else 1)
    link = cluster.gpu.nvlink_gbps if cluster.world_size <= cluster.gpus_per_node else cluster.gpu.ib_gbps
    return 2 * layout.vpp * (p2p_bytes / (link * 1e9 * a.link_efficiency) + a.collective_latency_s)


def _heaviest_stage_params(*, shape, layout, assumptions) -> tuple[int, int, int]:
    """(parameters, routed-expert parameters, stage) per GPU of the stage holding the most parameters."""
    return max((stage_params_per_gpu(shape=shape, layout=layout, stage=i, layer_spec=assumptions.layer_spec),
                stage_expert_params_per_gpu(shape=shape, layout=layout, stage=i), i)
               for i in representative_stages(shape=shape, layout=layout))


def _dp_traffic(*, shape, layout, cluster, num_micro, forward_s, backward_s, assumptions, lora=None) -> DpTraffic:
    """The heaviest stage's data-parallel traffic (toolkit/plan/zero_traffic.py): its non-expert parameters over
    megatron's dp-cp group (CP ranks hold the same weights), tp apart; each expert's replicas over expert_dp
    ranks, tp x ep apart (megatron's etp x ep x edp grid). With LoRA only the adapters (whole on every TP rank)
    carry gradients."""
    params, experts, stage = _heaviest_stage_params(shape=shape, layout=layout, assumptions=assumptions)
    groups = [(params - experts, layout.zero_size, layout.tp)]
    if experts:
        groups.append((experts, layout.expert_dp, layout.tp * layout.ep))
    dense, moe = _dense_and_moe(_stage_layer_kinds(shape=shape, layout=layout, stage=stage))
    modules = gathered_modules(shape=shape, layout=layout, layers=dense + moe, moe_layers=moe)
    last = stage == layout.pp - 1
    head = padded_vocab_size(shape=shape, tp=layout.tp) * shape.hidden_size // layout.tp if last else 0
    # with LoRA one trainable share for both groups: this GPU's adapters (its E / ep experts') over its parameters
    adapters = 0 if lora is None else stage_lora_params(shape=shape, lora=lora, layout=layout, stage=stage).total
    trainable = 1.0 if lora is None else min(1.0, adapters / params)
    return dp_traffic(layout=layout, cluster=cluster, num_micro=num_micro, groups=groups, modules=modules,
                      forward_compute_s=forward_s, backward_compute_s=backward_s, assumptions=assumptions,
                      layers=dense + moe, head_params=head, trainable=trainable)


def _optimizer_s(*, shape, layout, cluster, assumptions) -> float:
    """Adam is memory bound on the GPU; with offload it runs on the CPU behind PCIe transfers."""
    a = assumptions
    params, experts, _ = _heaviest_stage_params(shape=shape, layout=layout, assumptions=a)
    shard = params / (layout.zero_size if layout.zero_stage >= 1 else 1)
    if experts and layout.zero_stage >= 1:  # the experts' states are partitioned over expert_dp ranks only
        shard = (params - experts) / layout.zero_size + experts / layout.expert_dp
    if layout.offload_optimizer:
        pcie_bytes = shard * (a.master_grad_bytes + a.param_bytes)
        return shard / a.cpu_adam_params_per_s + pcie_bytes / (a.pcie_gbps * 1e9)
    state_bytes = shard * (a.optimizer_bytes_per_param + a.master_grad_bytes + a.param_bytes)
    return a.optimizer_passes * state_bytes / (cluster.gpu.hbm_gbps * 1e9)
