"""Per-GPU memory of a training layout: model states, activations, buffers, overhead; the worst stage decides.

This is the one memory model of dsmt: `dsmt plan` ranks layouts with it and `dsmt check` / `dsmt generate` call
`estimate_memory` for their fit check. Pure arithmetic on a ModelShape; nothing is imported from torch.

Sources
  * Model states: ZeRO (Rajbhandari et al. 2020) 2Ψ + 2Ψ + KΨ, with stage 1 partitioning the optimizer, stage 2
    also the gradients, stage 3 also the parameters, each over the data-parallel degree.
  * Activations: Korthikanti et al. 2022 ("Reducing activation recomputation"), section 4, Table 2, generalised
    to grouped-query attention and SwiGLU by counting the same stored tensors with the real widths.
  * In-flight micro-batches: megatron-core's 1F1B warm-up counts (schedules.py), which give Korthikanti's
    "first stage holds L layers" and the interleaved factor 1 + (p-1)/(p·v).
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.hardware import GpuSpec
from toolkit.plan.layout import RECOMPUTE_CHOICES, Layout, TrainingShape, num_micro_batches
from toolkit import shapes
from toolkit.shapes import ModelShape

DEFAULT_ASSUMPTIONS = Assumptions()
VOCAB_DIVISIBLE_BY = 128  # megatron's --make-vocab-size-divisible-by default; the padded vocab is split by tp
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "overhead")


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU on one pipeline stage, by category."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int
    params_per_gpu: int
    micro_batches_in_flight: float

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)

    def by_category(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in CATEGORIES}


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """The worst stage's bytes per GPU (the attributes), the stages looked at, and the device capacity."""

    worst: StageMemory
    stages: tuple[StageMemory, ...]
    capacity_bytes: int

    def __getattr__(self, name):  # parameters, gradients, ... of the worst stage
        if name in CATEGORIES or name in ("params_per_gpu", "micro_batches_in_flight", "stage"):
            return getattr(self.worst, name)
        raise AttributeError(name)

    @property
    def total_bytes(self) -> int:
        return self.worst.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    def by_category(self) -> dict[str, int]:
        return self.worst.by_category()


def padded_vocab_size(*, shape: ModelShape, tp: int) -> int:
    """The adapters' padded vocabulary (toolkit/shapes.py), rounded up to a multiple of tp so `// tp` is the
    rows one TP rank holds (a tp that does not divide it is refused by the layout checks anyway)."""
    padded = shapes.padded_vocab_size(shape.vocab_size, multiple=VOCAB_DIVISIBLE_BY)
    return -(-padded // tp) * tp


def layer_params_per_gpu(*, shape: ModelShape, tp: int) -> int:
    """One transformer layer's parameters on one TP rank: matmuls split by tp, the two norms replicated."""
    norms = 2 * shape.hidden_size
    return (shape.params_per_layer() - norms) // tp + norms


def stage_params_per_gpu(*, shape: ModelShape, layout: Layout, stage: int) -> int:
    """Parameters held by one GPU of pipeline stage `stage` (0-based).

    Embedding on the first stage, final norm and output layer on the last. A tied output layer is the embedding
    itself at pp=1; at pp>1 the last stage keeps its own copy, kept equal by an all-reduce (megatron).
    """
    vocab_rows = padded_vocab_size(shape=shape, tp=layout.tp) // layout.tp
    count = layer_params_per_gpu(shape=shape, tp=layout.tp) * (shape.num_layers // layout.pp)
    if stage == 0:
        count += vocab_rows * shape.hidden_size
    if stage == layout.pp - 1:
        count += shape.hidden_size  # final norm
        if not shape.tied_embeddings or layout.pp > 1:
            count += vocab_rows * shape.hidden_size
    return count


def model_state_bytes(*, num_params: int, dp: int, zero_stage: int, offload_optimizer: bool = False,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> dict[str, int]:
    """Parameters, gradients and optimizer bytes per GPU for `num_params` held by each of `dp` replicas.

    ZeRO paper: 16Ψ baseline; stage 1: 4Ψ + KΨ/Nd; stage 2: 2Ψ + (2+K)Ψ/Nd; stage 3: (2+2+K)Ψ/Nd.
    The fp32 gradient copy (`master_grad_bytes`) is partitioned like the optimizer state it feeds.
    """
    a = assumptions

    def part(bytes_per_param: int, partitioned: bool) -> int:
        return bytes_per_param * num_params // (dp if partitioned else 1)

    optimizer = part(a.optimizer_bytes_per_param, zero_stage >= 1)
    master_grads = part(a.master_grad_bytes, zero_stage >= 1)
    if offload_optimizer:  # ZeRO-Offload keeps optimizer states and fp32 gradients in host memory
        optimizer = master_grads = 0
    return {
        "parameters": part(a.param_bytes, zero_stage >= 3),
        "gradients": part(a.grad_bytes, zero_stage >= 2) + master_grads,
        "optimizer": optimizer,
    }


def activation_bytes_per_layer(*, shape: ModelShape, seq_length: int, micro_batch_size: int, tp: int,
                               sequence_parallel: bool, recompute: str,
                               assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> int:
    """Stored activations of one transformer layer for one micro-batch on one TP rank (Korthikanti Table 2).

    Per token, with h hidden, a heads, g KV heads, d head dim, f FFN width, bf16 (2 bytes) and 1-byte masks:
      replicated across TP unless SP splits them: the inputs of both norms, of QKV and of FC1 (4 x 2h bytes),
        plus two dropout masks (2 x h bytes) when the model uses dropout          -> Korthikanti's "10"
      split by TP: Q (2ad), K and V (2gd each), the output-projection input (2ad), the MLP's stored
        activations (2 x 2f for GeLU, 3 x 2f for fused SwiGLU)                    -> Korthikanti's "24"
      attention core, split by TP: softmax output (2as), with dropout also its mask and output (3as)
                                                                                  -> Korthikanti's "5as/h"
    Selective recompute drops the attention core; flash attention never stores it (only an fp32 log-sum-exp
    per head); full recompute keeps only the layer input (2h, split by SP).
    """
    a, h, s, b = assumptions, shape.hidden_size, seq_length, micro_batch_size
    tokens = s * b
    ab = a.activation_bytes
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * h * ab // sp_div
    heads, kv_heads, d = shape.num_attention_heads, shape.num_kv_heads, shape.kv_channels
    replicated = 4 * h * ab + (2 * h if a.dropout else 0)
    mlp_tensors = 3 if shape.gated_mlp else 2
    split = (2 * heads * d + 2 * kv_heads * d) * ab + mlp_tensors * shape.ffn_hidden_size * ab
    if a.flash_attention:
        core = 4 * heads  # fp32 log-sum-exp per head
    elif recompute == "selective":
        core = 0
    else:
        core = heads * s * (5 if a.dropout else ab)
    return tokens * replicated // sp_div + tokens * (split + core) // tp


def micro_batches_in_flight(*, layout: Layout, num_micro: int, stage: int) -> float:
    """Micro-batches (in units of a whole stage's layers) whose activations stage `stage` holds at peak.

    megatron-core 1F1B: stage s runs p-s-1 warm-up forwards then holds one more -> min(p-s, m). Interleaved:
    (p-s-1)·2 + (v-1)·p warm-up chunks + 1, each 1/v of the stage -> 1 + (p-1)/(p·v) stages' worth at s=0.
    """
    p, v = layout.pp, layout.vpp
    if v <= 1:
        return float(min(p - stage, num_micro))
    chunks = min((p - stage - 1) * 2 + (v - 1) * p + 1, num_micro * v)
    return chunks / v


def stage_memory(*, shape: ModelShape, layout: Layout, training: TrainingShape, stage: int,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> StageMemory:
    """Memory per GPU of pipeline stage `stage`."""
    a = assumptions
    params = stage_params_per_gpu(shape=shape, layout=layout, stage=stage)
    states = model_state_bytes(num_params=params, dp=layout.dp, zero_stage=layout.zero_stage,
                               offload_optimizer=layout.offload_optimizer, assumptions=a)
    in_flight = micro_batches_in_flight(layout=layout, num_micro=num_micro_batches(layout=layout, training=training),
                                        stage=stage)
    per_layer = activation_bytes_per_layer(
        shape=shape, seq_length=training.seq_length, micro_batch_size=layout.micro_batch_size, tp=layout.tp,
        sequence_parallel=layout.sp, recompute=layout.recompute, assumptions=a)
    activations = int(per_layer * (shape.num_layers // layout.pp) * in_flight)
    if stage == layout.pp - 1:
        activations += output_layer_activation_bytes(shape=shape, layout=layout, training=training, assumptions=a)
    buffers = _buffer_bytes(shape=shape, layout=layout, params=params, assumptions=a)
    subtotal = sum(states.values()) + activations + buffers
    overhead = int(a.framework_overhead_gb * 1e9 + a.fragmentation_fraction * subtotal)
    return StageMemory(stage=stage, activations=activations, buffers=buffers, overhead=overhead,
                       params_per_gpu=params, micro_batches_in_flight=in_flight, **states)


def output_layer_activation_bytes(*, shape, layout, training, assumptions) -> int:
    """Last stage, one micro-batch (its backward follows its forward at once): final-norm and output-layer
    inputs (2h each, split by SP) and the vocab-parallel logits, bf16 plus an fp32 copy for the loss."""
    tokens = training.seq_length * layout.micro_batch_size
    ab = assumptions.activation_bytes
    inputs = 2 * tokens * shape.hidden_size * ab // (layout.tp if layout.sp else 1)
    vocab_slice = padded_vocab_size(shape=shape, tp=layout.tp) // layout.tp
    return inputs + tokens * vocab_slice * (ab + (4 if assumptions.logits_fp32 else 0))


def largest_gathered_params(*, shape: ModelShape, tp: int) -> int:
    """The largest unit ZeRO-3 gathers at once on one TP rank: a layer or the embedding (DeepSpeed's
    'largest_layer_params')."""
    embedding = padded_vocab_size(shape=shape, tp=tp) // tp * shape.hidden_size
    return max(layer_params_per_gpu(shape=shape, tp=tp), embedding)


def _buffer_bytes(*, shape, layout, params, assumptions) -> int:
    """Gradient reduce bucket; ZeRO-3 adds the prefetch bucket and the gathered largest unit with its
    gradient (DeepSpeed's 4 x largest_layer_params)."""
    a = assumptions
    buffers = min(a.reduce_bucket_elements, params) * a.grad_bytes
    if layout.zero_stage >= 3:
        largest = largest_gathered_params(shape=shape, tp=layout.tp)
        buffers += largest * (a.param_bytes + a.grad_bytes)
        buffers += min(a.zero3_prefetch_elements, params) * a.param_bytes
    return buffers


def _require_computable(*, shape: ModelShape, layout: Layout) -> None:
    """The few rules without which the arithmetic is meaningless; `layout_violations` checks the rest."""
    if min(layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch_size) < 1:
        raise DsmtError(f"tp, pp, dp, vpp and micro_batch_size must be >= 1, got {layout.label()}")
    if shape.num_layers % (layout.pp * layout.vpp):
        valid = [d for d in range(1, shape.num_layers + 1) if shape.num_layers % d == 0]
        raise DsmtError(f"pp({layout.pp}) * vpp({layout.vpp}) does not divide num_layers={shape.num_layers}; "
                        f"valid pp * vpp: {', '.join(map(str, valid))}")
    if layout.recompute not in RECOMPUTE_CHOICES:
        raise DsmtError(f"recompute={layout.recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)}")


def require_fit(memory: MemoryBreakdown) -> None:
    """Raise a DsmtError naming the worst stage's breakdown and the usual fixes when `memory` does not fit."""
    if memory.fits:
        return
    parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in memory.by_category().items())
    raise DsmtError(
        f"the layout needs {memory.total_bytes / 1e9:.1f} GB per GPU on pipeline stage {memory.worst.stage} "
        f"({parts} GB) but the GPU has {memory.capacity_bytes / 1e9:.1f} GB; raise tp or pp, use ZeRO-1 or "
        "higher, recompute activations, lower micro_batch_size, or run `dsmt plan` for layouts that fit")


def estimate_memory(*, shape: ModelShape, layout: Layout, training: TrainingShape, gpu: GpuSpec,
                    assumptions: Assumptions = DEFAULT_ASSUMPTIONS, all_stages: bool = False) -> MemoryBreakdown:
    """Memory per GPU for `layout`; the worst pipeline stage decides.

    Only the first and last stages can be the worst (the first holds the most micro-batches and the embedding,
    the last the output layer and logits), so only they are computed unless `all_stages`.
    """
    _require_computable(shape=shape, layout=layout)
    indices = range(layout.pp) if all_stages else sorted({0, layout.pp - 1})
    stages = tuple(stage_memory(shape=shape, layout=layout, training=training, stage=i, assumptions=assumptions)
                   for i in indices)
    worst = max(stages, key=lambda m: m.total_bytes)
    return MemoryBreakdown(worst=worst, stages=stages, capacity_bytes=gpu.memory_bytes)
