"""Predicted step time of a layout: compute, tensor/pipeline/data-parallel communication, bubble, optimizer.

Sources
  * FLOPs: Narayanan et al. 2021 (Megatron-LM at scale), section 5.1: with full recompute
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)); here counted from the real matmul widths (GQA, SwiGLU) as
    2 FLOPs per multiply-add, 3 passes (forward, backward-data, backward-weight), +1 forward of the layers for
    full recompute, +1 forward of the attention core for selective recompute.
  * Pipeline bubble (p-1)/(v·m) (same paper, section 2.2); TP traffic 8·b·s·h·(t-1)/t elements per layer per
    micro-batch (4 all-reduces; 6 with full recompute).
  * Collectives: ring bounds from nccl-tests PERFORMANCE.md, all-reduce 2(n-1)/n·S/B, reduce-scatter and
    all-gather (n-1)/n·S/B.
  * Data parallel per DeepSpeed: ZeRO-0/1 reduce once per step; ZeRO-2 reduce-scatters the gradients of every
    micro-batch; ZeRO-3 also all-gathers the parameters for each forward and backward.
"""

from __future__ import annotations

import dataclasses

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import Cluster, Layout, TrainingShape, num_micro_batches
from toolkit.plan.memory import DEFAULT_ASSUMPTIONS, padded_vocab_size, stage_params_per_gpu
from toolkit.shapes import ModelShape


@dataclasses.dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float          # matmul time of the slowest stage over the step, bubble excluded
    tp_comm_s: float          # exposed tensor-parallel collectives over the step
    pp_comm_s: float          # pipeline point-to-point over the step
    bubble_s: float           # pipeline fill and drain
    dp_comm_s: float          # exposed data-parallel collectives
    optimizer_s: float
    bubble_fraction: float    # (p-1)/(v·m), the paper's bubble time over ideal time
    flops_per_step: float     # hardware FLOPs, recompute included
    model_flops_per_step: float   # FLOPs without recompute (the MFU numerator)
    tokens_per_s: float
    mfu: float


def layer_forward_flops(*, shape: ModelShape, tokens: int, seq_length: int) -> tuple[float, float]:
    """(matmul FLOPs, attention-core FLOPs) of one layer's forward over `tokens` tokens."""
    matmul_params = shape.params_per_layer() - 2 * shape.hidden_size
    core = 4.0 * tokens * seq_length * shape.num_attention_heads * shape.kv_channels  # QK^T and AV
    return 2.0 * tokens * matmul_params, core


def training_flops(*, shape: ModelShape, tokens: int, seq_length: int, recompute: str, tp: int = 1) -> float:
    """Training FLOPs (forward + backward, recompute included) of the whole model over `tokens` tokens."""
    matmul, core = layer_forward_flops(shape=shape, tokens=tokens, seq_length=seq_length)
    passes = 4.0 if recompute == "full" else 3.0
    extra_core = core if recompute == "selective" else 0.0
    logits = 2.0 * tokens * padded_vocab_size(shape=shape, tp=tp) * shape.hidden_size
    return shape.num_layers * ((matmul + core) * passes + extra_core) + 3.0 * logits


def ring_time_s(*, kind: str, message_bytes: float, group_size: int, bandwidth_gbps: float,
                assumptions: Assumptions) -> float:
    """Ring-bound time of one collective (nccl-tests): all_reduce 2(n-1)/n, others (n-1)/n, times S/B."""
    if group_size <= 1 or message_bytes <= 0:
        return 0.0
    factor = (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size
    bandwidth = bandwidth_gbps * 1e9 * assumptions.link_efficiency
    return factor * message_bytes / bandwidth + assumptions.collective_latency_s


def _link_gbps(*, span_gpus: int, cluster: Cluster) -> float:
    """A group whose ranks span `span_gpus` consecutive GPUs stays on NVLink only inside one node."""
    return cluster.gpu.nvlink_gbps if span_gpus <= cluster.gpus_per_node else cluster.gpu.ib_gbps


def estimate_step_time(*, shape: ModelShape, layout: Layout, training: TrainingShape, cluster: Cluster,
                       assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> StepTime:
    """Predicted time of one optimizer step. Rank order is megatron's: tp fastest, then dp, then pp."""
    a, gpu = assumptions, cluster.gpu
    m, p, v, t = num_micro_batches(layout=layout, training=training), layout.pp, layout.vpp, layout.tp
    s = training.seq_length
    compute_mb_s, tp_mb_s, pp_mb_s = _per_micro_batch_s(shape=shape, layout=layout, training=training,
                                                        cluster=cluster, assumptions=a)
    per_mb_s = compute_mb_s + tp_mb_s + pp_mb_s
    bubble_s = (p - 1) / v * per_mb_s
    dp_s = _dp_comm_s(shape=shape, layout=layout, cluster=cluster, num_micro=m, assumptions=a)
    optimizer_s = _optimizer_s(shape=shape, layout=layout, cluster=cluster, assumptions=a)
    step_s = m * per_mb_s + bubble_s + dp_s * (1.0 - a.dp_overlap) + optimizer_s
    global_tokens = training.global_batch_size * s
    model_flops = training_flops(shape=shape, tokens=global_tokens, seq_length=s, recompute="none", tp=t)
    hw_flops = training_flops(shape=shape, tokens=global_tokens, seq_length=s, recompute=layout.recompute, tp=t)
    return StepTime(
        step_time_s=step_s, compute_s=m * compute_mb_s, tp_comm_s=m * tp_mb_s, pp_comm_s=m * pp_mb_s,
        bubble_s=bubble_s, dp_comm_s=dp_s * (1.0 - a.dp_overlap), optimizer_s=optimizer_s,
        bubble_fraction=(p - 1) / (v * m), flops_per_step=hw_flops, model_flops_per_step=model_flops,
        tokens_per_s=global_tokens / step_s,
        mfu=model_flops / (step_s * cluster.world_size * gpu.peak_bf16_tflops * 1e12),
    )


def _per_micro_batch_s(*, shape, layout, training, cluster, assumptions) -> tuple[float, float, float]:
    """(compute, exposed TP comm, PP p2p) of one micro-batch through the slowest stage (the last: its layers
    plus the logits)."""
    a, t, p, v = assumptions, layout.tp, layout.pp, layout.vpp
    s, tokens = training.seq_length, training.seq_length * layout.micro_batch_size
    ab = a.activation_bytes
    matmul, core = layer_forward_flops(shape=shape, tokens=tokens, seq_length=s)
    passes = 4.0 if layout.recompute == "full" else 3.0
    layer_flops = (matmul + core) * passes + (core if layout.recompute == "selective" else 0.0)
    vocab = padded_vocab_size(shape=shape, tp=t)
    stage_flops = (layer_flops * (shape.num_layers // p) + 6.0 * tokens * vocab * shape.hidden_size) / t
    compute_s = stage_flops / (cluster.gpu.peak_bf16_tflops * 1e12 * a.efficiency)
    # Tensor parallel: 4 all-reduces (or reduce-scatter + all-gather pairs under SP) per layer per micro-batch.
    tp_calls = 6 if layout.recompute == "full" else 4
    tp_one = ring_time_s(kind="all_reduce", message_bytes=tokens * shape.hidden_size * ab, group_size=t,
                         bandwidth_gbps=_link_gbps(span_gpus=t, cluster=cluster), assumptions=a)
    tp_s = tp_one * tp_calls * (shape.num_layers // p) * (1.0 - a.tp_overlap)
    # Pipeline: each of the v chunks sends activations forward and gradients backward per micro-batch.
    pp_s = 0.0
    if p > 1:
        p2p_bytes = tokens * shape.hidden_size * ab / (t if layout.sp else 1)
        link = _link_gbps(span_gpus=t * layout.dp * 2, cluster=cluster)
        pp_s = 2 * v * (p2p_bytes / (link * 1e9 * a.link_efficiency) + a.collective_latency_s)
    return compute_s, tp_s, pp_s


def _dp_comm_s(*, shape, layout, cluster, num_micro, assumptions) -> float:
    """Data-parallel collectives of the heaviest stage over one step (before overlap)."""
    dp = layout.dp
    if dp <= 1:
        return 0.0
    params = max(stage_params_per_gpu(shape=shape, layout=layout, stage=i) for i in {0, layout.pp - 1})
    grad_bytes = params * assumptions.grad_bytes
    link = _link_gbps(span_gpus=layout.tp * dp, cluster=cluster)

    def ring(kind, count):
        return count * ring_time_s(kind=kind, message_bytes=grad_bytes, group_size=dp, bandwidth_gbps=link,
                                   assumptions=assumptions)

    if layout.zero_stage <= 1:
        return ring("all_reduce", 1)   # ZeRO-1: reduce-scatter + all-gather, the same volume
    if layout.zero_stage == 2:
        return ring("reduce_scatter", num_micro) + ring("all_gather", 1)
    return ring("reduce_scatter", num_micro) + ring("all_gather", 2 * num_micro)


def _optimizer_s(*, shape, layout, cluster, assumptions) -> float:
    """Adam is memory bound on the GPU; with offload it runs on the CPU behind PCIe transfers."""
    a = assumptions
    params = max(stage_params_per_gpu(shape=shape, layout=layout, stage=i) for i in {0, layout.pp - 1})
    shard = params / (layout.dp if layout.zero_stage >= 1 else 1)
    if layout.offload_optimizer:
        pcie_bytes = shard * (a.master_grad_bytes + a.param_bytes)
        return shard / a.cpu_adam_params_per_s + pcie_bytes / (a.pcie_gbps * 1e9)
    state_bytes = shard * (a.optimizer_bytes_per_param + a.master_grad_bytes + a.param_bytes)
    return a.optimizer_passes * state_bytes / (cluster.gpu.hbm_gbps * 1e9)
