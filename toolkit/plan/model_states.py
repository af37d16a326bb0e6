"""Parameters, gradients and optimizer states per GPU as DeepSpeed 0.19 allocates them with dsmt's config.

dsmt's generated config (toolkit/generate/deepspeed_config.py) picks one of five DeepSpeed optimizers
(`DeepSpeedEngine._do_optimizer_sanity_check` in deepspeed/runtime/engine.py):
  fp32, ZeRO-0          the client torch AdamW itself (no wrapper)
  16-bit, ZeRO-0        FP16_UnfusedOptimizer (bf16 needs grad_accum_dtype bf16)   runtime/fp16/unfused_optimizer.py
  16-bit, ZeRO-1        BF16_Optimizer (fp32 accumulation)                                runtime/bf16_optimizer.py
  fp32 ZeRO-1/2, 16-bit ZeRO-2   DeepSpeedZeroOptimizer                                    runtime/zero/stage_1_and_2.py
  ZeRO-3                DeepSpeedZeroOptimizer_Stage3                                     runtime/zero/stage3.py
Each keeps a fixed set of buffers, listed below with the attribute that holds them. A buffer has a width in bytes
per parameter (an Assumptions field) and a share: "whole" (every parameter), "partition" (this rank's 1/dp slice of
the flat parameter group) or "overlap" (the whole gradients of every parameter that overlaps that slice: DeepSpeed's
per-parameter gradient lists at fp32 ZeRO-1/2, larger than the slice by the parameters its boundaries cut). It
lives all step long or only at one of two moments: "backward" (every micro-batch's gradient accumulated,
before the boundary's reduction) and "step" (inside the optimizer step). A category's figure is its larger moment;
parameters and optimizer states are the same at both, so the three figures add up to the model-state peak.
The table was read from those files and checked tensor by tensor against live engines on every rank
(tests/plan/test_live_engine.py, benchmarks/plan_vs_live.py).

The ZeRO paper (Rajbhandari et al. 2020) counts 2 + 2 + 12 bytes per parameter; DeepSpeed holds more: fp32 gradient
buffers (BF16_Optimizer keeps a whole fp32 accumulation buffer at ZeRO-1) and, at the step, a second copy of the
gradient partition (the flattened fp32 `.grad` the torch optimizer reads). tests/plan/test_published.py names each
difference.
"""

from __future__ import annotations

import dataclasses

from toolkit.plan.assumptions import Assumptions

MOMENTS = ("backward", "step")
MODEL_STATE_CATEGORIES = ("parameters", "gradients", "optimizer")


@dataclasses.dataclass(frozen=True)
class Buffer:
    holder: str                       # where DeepSpeed keeps it, for the reader and the live comparison
    category: str                     # parameters | gradients | optimizer
    width: str                        # the Assumptions field giving its bytes per parameter
    share: str                        # whole | partition | overlap
    moments: tuple[str, ...] = MOMENTS


def _buffers_fp32(stage: int) -> tuple[Buffer, ...]:
    weights = Buffer("model parameters", "parameters", "param_bytes", "whole")
    if stage == 0:
        return (weights, Buffer("param.grad", "gradients", "grad_bytes", "whole"),
                Buffer("torch AdamW state exp_avg, exp_avg_sq", "optimizer", "adam_moment_bytes", "whole"))
    optimizer = (Buffer("single_partition_of_fp32_groups (a clone, even in fp32)", "optimizer", "master_weight_bytes",
                        "partition"),
                 Buffer("AdamW state of the partition", "optimizer", "adam_moment_bytes", "partition"))
    step_copies = (Buffer("averaged_gradients (whole gradients of the partition's parameters)", "gradients",
                          "master_grad_bytes", "overlap", ("step",)),
                   Buffer("single_partition_of_fp32_groups[i].grad (flattened slice)", "gradients",
                          "master_grad_bytes", "partition", ("step",)))
    if stage == 1:  # param.grad accumulates whole over the micro-batches; reduced into the partition at the boundary
        accumulated = (Buffer("param.grad", "gradients", "grad_bytes", "whole", ("backward",)),)
    elif stage == 2:  # reduced per micro-batch: param.grad of the partition's parameters, summed in all_grad_tensors
        accumulated = (Buffer("param.grad of the partition's parameters", "gradients", "grad_bytes", "overlap",
                              ("backward",)),
                       Buffer("all_grad_tensors", "gradients", "master_grad_bytes", "overlap", ("backward",)))
    else:
        return _buffers_stage3()
    return (weights,) + accumulated + step_copies + optimizer


def _buffers_16bit(stage: int) -> tuple[Buffer, ...]:
    weights = Buffer("model parameters", "parameters", "param_bytes", "whole")
    optimizer_whole = Buffer("fp32 master weights + AdamW state", "optimizer", "optimizer_bytes_per_param", "whole")
    optimizer = dataclasses.replace(optimizer_whole, holder="fp32 master partition + its AdamW state",
                                    share="partition")
    if stage == 0:  # bf16 gradients accumulate in param.grad; the step copies all of them to fp32 (fp32_groups[.].grad)
        return (weights, Buffer("param.grad (16-bit)", "gradients", "grad_bytes", "whole"),
                Buffer("fp32_groups[i][j].grad", "gradients", "master_grad_bytes", "whole", ("step",)), optimizer_whole)
    if stage == 1:  # immediate_grad_update moves each bf16 gradient into the WHOLE fp32 buffer as backward makes it
        return (weights, Buffer("fp32_groups_gradients_flat (param._hp_grad)", "gradients", "master_grad_bytes",
                                "whole"), optimizer)
    if stage == 2:  # fp32 accumulation != bf16 weights: the compact fp32 partition buffer becomes the master's .grad
        return (weights, Buffer("averaged_gradients (compact fp32 partition)", "gradients", "master_grad_bytes",
                                "partition"), optimizer)
    return _buffers_stage3()


def _buffers_stage3() -> tuple[Buffer, ...]:
    """The same buffers in fp32 and 16-bit runs (the gradient partition is fp32 either way)."""
    return (Buffer("param.ds_tensor (fp16_partitioned_groups_flat)", "parameters", "param_bytes", "partition"),
            Buffer("grad_partitions_flat_buffer", "gradients", "master_grad_bytes", "partition"),
            Buffer("fp32_partitioned_groups_flat[i].grad (copy)", "gradients", "master_grad_bytes", "partition",
                   ("step",)),
            Buffer("fp32_partitioned_groups_flat + AdamW state", "optimizer", "optimizer_bytes_per_param", "partition"))


def buffers(*, precision: str, zero_stage: int) -> tuple[Buffer, ...]:
    """DeepSpeed's model-state buffers for a precision and ZeRO stage (fp16 is taken as bf16: not measured, DeepSpeed
    refuses fp16 on CPU)."""
    return _buffers_fp32(zero_stage) if precision == "fp32" else _buffers_16bit(zero_stage)


def model_state_bytes(*, num_params: int, dp: int, zero_stage: int, offload_optimizer: bool = False,
                      persistent_params: int = 0, overlap_params: int | None = None,
                      assumptions: Assumptions = Assumptions()) -> dict[str, int]:
    """Parameters, gradients and optimizer bytes per GPU for `num_params` held by each of `dp` replicas.

    `overlap_params`: elements of the whole parameters overlapping this rank's partition (memory.py computes them
    from the tensor list; default: the partition itself). `persistent_params`: at ZeRO-3, the parameters below
    stage3_param_persistence_threshold; DeepSpeed keeps them whole on every rank besides their partition. With
    `offload_optimizer` (ZeRO-Offload, Ren et al. 2021) the fp32 master weights, Adam moments and fp32 gradient
    partitions live in host memory; the device keeps the working weights and their 16-bit gradients (partitioned
    from ZeRO-2): not measured here (no GPU on the CI machine)."""
    partition = -(-num_params // dp)
    elements = {"whole": num_params, "partition": partition,
                "overlap": partition if overlap_params is None else overlap_params}

    if offload_optimizer:
        return {"parameters": assumptions.param_bytes * (partition if zero_stage >= 3 else num_params),
                "gradients": assumptions.grad_bytes * (partition if zero_stage >= 2 else num_params), "optimizer": 0}
    held = {(category, moment): 0 for category in MODEL_STATE_CATEGORIES for moment in MOMENTS}
    for buffer in buffers(precision=assumptions.precision, zero_stage=zero_stage):
        for moment in buffer.moments:
            held[buffer.category, moment] += getattr(assumptions, buffer.width) * elements[buffer.share]
    states = {category: max(held[category, moment] for moment in MOMENTS) for category in MODEL_STATE_CATEGORIES}
    if zero_stage >= 3:
        states["parameters"] += assumptions.param_bytes * persistent_params
    return states
