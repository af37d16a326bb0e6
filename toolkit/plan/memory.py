"""Per-GPU memory of a training layout: model states, activations, buffers, overhead; the worst stage decides.

This is the one memory model of dsmt: `dsmt plan` ranks layouts with it and `dsmt check` / `dsmt generate` call
`estimate_memory` for their fit check. Pure arithmetic on a ModelShape; nothing is imported from torch.

Sources
  * Model states: the buffers DeepSpeed 0.19 really allocates for dsmt's config, per precision and ZeRO stage
    (toolkit/plan/model_states.py, checked against live engines: tests/plan/test_live_engine.py); the ZeRO paper
    (Rajbhandari et al. 2020) is the baseline they are compared with (tests/plan/test_published.py).
  * Activations: Korthikanti et al. 2022, Table 2, generalised to grouped-query attention, SwiGLU and megatron-core's
    local layers (toolkit/plan/activations.py, checked against megatron-core's forward: tests/plan/test_measured.py).
  * In-flight micro-batches: megatron-core's 1F1B warm-up counts (schedules.py), which give Korthikanti's
    "first stage holds L layers" and the interleaved factor 1 + (p-1)/(p·v).
  * Mixture of experts: each rank holds E / ep experts of every MoE layer, split over tp as megatron-core's expert
    TP (etp = tp) does; their states are partitioned over expert_dp = dp × cp / ep, the rest (shared experts
    included) over dp × cp (toolkit/plan/experts.py). Which tensors a layer holds, multi-latent attention's and
    dense first layers' included, and which layers a stage holds: toolkit/plan/layers.py.
  * DPO (toolkit/plan/dpo.py): activations for the micro-batch's rows (a pair is one row packed, two unpacked), the
    frozen reference's weights as a category of their own ("reference", shown only where a copy is held) and its
    no_grad forward's transient where larger than the policy's activations.
  * ZeRO-3 build: zero.Init partitions each module as it is built and the checkpoint loads one parameter at a time
    (toolkit/adapters/zero3.py): a rank holds its partition plus one module before any optimizer state exists.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from toolkit.errors import DsmtError
from toolkit.plan.activations import (ROPE_FREQ_BYTES, activation_bytes_per_layer, heads_per_rank,  # noqa: F401
                                      output_layer_activation_bytes as _output_layer_bytes)
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.dpo import reference_forward_bytes, reference_weight_bytes, row_layout
from toolkit.plan.experts import require_expert_layout
from toolkit.plan.hardware import GpuSpec
from toolkit.plan.layers import (ONE_D_TENSORS, VOCAB_DIVISIBLE_BY, layer_params_per_gpu,  # noqa: F401 (re-exported)
                                 layer_tensors, padded_vocab_size, representative_stages, stage_expert_params_per_gpu,
                                 stage_layer_counts, stage_layer_kinds, stage_params_per_gpu, stage_tensors)
from toolkit.plan.layout import RECOMPUTE_CHOICES, PlanLayout, TrainingShape, num_micro_batches
from toolkit.plan.model_states import model_state_bytes  # noqa: F401  (re-exported for callers of this module)
from toolkit.models.mixer_shapes import ATTENTION
from toolkit.models.shapes import ModelShape

DEFAULT_ASSUMPTIONS = Assumptions()
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "overhead")
# DPO's frozen reference weights sit after the model states; a breakdown shows them only where a copy is held, so
# an SFT plan's columns are unchanged.
WITH_REFERENCE = CATEGORIES[:3] + ("reference",) + CATEGORIES[3:]


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per GPU on one pipeline stage, by category, and the build-time peak before training starts."""

    stage: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int
    params_per_gpu: int
    micro_batches_in_flight: float
    build_peak: int = 0  # building and loading the model, before any gradient or optimizer state exists
    expert_params_per_gpu: int = 0  # the part of params_per_gpu that is MoE experts (0 for a dense model)
    reference: int = 0  # DPO: the frozen reference's weights (toolkit/plan/dpo.py)

    @property
    def total_bytes(self) -> int:
        return sum(self.by_category().values())

    def by_category(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in (WITH_REFERENCE if self.reference else CATEGORIES)}


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """The worst stage's bytes per GPU (the attributes), the stages looked at, and the device capacity."""

    worst: StageMemory
    stages: tuple[StageMemory, ...]
    capacity_bytes: int

    def __getattr__(self, name):  # parameters, gradients, ... of the worst stage
        if name in WITH_REFERENCE or name in ("params_per_gpu", "expert_params_per_gpu", "micro_batches_in_flight",
                                          "stage"):
            return getattr(self.worst, name)
        raise AttributeError(name)

    @property
    def total_bytes(self) -> int:
        return self.worst.total_bytes

    @property
    def build_peak_bytes(self) -> int:
        """The largest stage's build-time peak (ZeRO-3: partition + one module; otherwise the whole weights)."""
        return max(stage.build_peak for stage in self.stages)

    @property
    def peak_bytes(self) -> int:
        return max(self.total_bytes, self.build_peak_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    def by_category(self) -> dict[str, int]:
        return self.worst.by_category()


def persistent_params(*, shape: ModelShape, layout: PlanLayout, stage: int, threshold: int,
                      layer_spec: str = "te") -> int:
    """ZeRO-3 keeps parameters with fewer than `threshold` elements whole on every rank (DeepSpeed's
    stage3_param_persistence_threshold: `ds_persist`, partition_parameters.py); at scale only the norms."""
    if layout.zero_stage < 3:
        return 0
    return sum(numel * count for _, numel, count in stage_tensors(shape=shape, layout=layout, stage=stage,
                                                                  layer_spec=layer_spec) if numel < threshold)


def _optimizer_groups(*, shape: ModelShape, layout: PlanLayout, stage: int,
                      layer_spec: str = "te") -> tuple[list[int], list[int]]:
    """The stage's parameter sizes as DeepSpeed's two parameter groups hold them, in megatron-core's module order
    (approximately: each layer's tensors in layer_tensors' order): the matrices (weight decay) and the 1-D norms and
    biases (none; toolkit/train/engine/hybrid.py `weight_decay_groups`). MoE experts are a group of their own,
    partitioned over expert_dp: not listed here."""
    vocab = padded_vocab_size(shape=shape, tp=layout.tp) // layout.tp * shape.hidden_size
    matrices, norms = ([vocab] if stage == 0 else []), []
    for (is_moe, mixer), count in stage_layer_kinds(shape=shape, layout=layout, stage=stage).items():
        tensors = layer_tensors(shape=shape, tp=layout.tp, moe=is_moe, layer_spec=layer_spec, mixer=mixer)
        matrices += [numel for name, numel in tensors.items() if name not in ONE_D_TENSORS] * count
        norms += [numel for name, numel in tensors.items() if name in ONE_D_TENSORS] * count
    if stage == layout.pp - 1:
        norms.append(shape.hidden_size)
        if not shape.tied_embeddings or layout.pp > 1:
            matrices.append(vocab)
    return matrices, norms


def partition_overlap_params(*, shape: ModelShape, layout: PlanLayout, stage: int, dp_rank: int | None = None,
                             layer_spec: str = "te") -> int:
    """Elements of the whole parameters overlapping a rank's 1/dp slice of each flat parameter group (the worst
    rank's when `dp_rank` is None). DeepSpeed flattens each group (aligned to 2·dp elements) and cuts it into dp
    equal slices; its fp32 ZeRO-1/2 gradient lists hold the whole gradient of every parameter a slice touches."""
    dp = layout.zero_size
    ranks = range(dp) if dp_rank is None else [dp_rank]
    per_rank = dict.fromkeys(ranks, 0)
    for sizes in _optimizer_groups(shape=shape, layout=layout, stage=stage, layer_spec=layer_spec):
        ends = list(itertools.accumulate(sizes))
        starts = [0] + ends[:-1]
        size = -(-ends[-1] // (2 * dp)) * 2
        for rank in ranks:  # the tensors ending after the slice starts and starting before it ends
            first, last = bisect.bisect_right(ends, rank * size), bisect.bisect_left(starts, (rank + 1) * size)
            per_rank[rank] += ends[last - 1] - starts[first] if last > first else 0
    return max(per_rank.values())


def output_layer_activation_bytes(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape,
                                  assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> int:
    """The last stage's final norm, output layer and loss for one micro-batch (toolkit/plan/activations.py)."""
    return _output_layer_bytes(shape=shape, tp=layout.tp, sequence_parallel=layout.sp,
                               seq_length=training.seq_length, micro_batch_size=layout.micro_batch_size,
                               padded_vocab=padded_vocab_size(shape=shape, tp=layout.tp), assumptions=assumptions,
                               cp=layout.cp)


def micro_batches_in_flight(*, layout: PlanLayout, num_micro: int, stage: int) -> float:
    """Micro-batches (in units of a whole stage's layers) whose activations stage `stage` holds at peak.

    megatron-core 1F1B: stage s runs p-s-1 warm-up forwards then holds one more -> min(p-s, m). Interleaved:
    (p-s-1)·2 + (v-1)·p warm-up chunks + 1, each 1/v of the stage -> 1 + (p-1)/(p·v) stages' worth at s=0.
    """
    p, v = layout.pp, layout.vpp
    if v <= 1:
        return float(min(p - stage, num_micro))
    chunks = min((p - stage - 1) * 2 + (v - 1) * p + 1, num_micro * v)
    return chunks / v


def stage_memory(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, stage: int,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS, dp_rank: int | None = None) -> StageMemory:
    """Memory per GPU of pipeline stage `stage` (its worst data-parallel rank, or `dp_rank`'s)."""
    a = assumptions
    params = stage_params_per_gpu(shape=shape, layout=layout, stage=stage, layer_spec=a.layer_spec)
    expert_params = stage_expert_params_per_gpu(shape=shape, layout=layout, stage=stage)
    persistent = persistent_params(shape=shape, layout=layout, stage=stage, threshold=a.zero3_persistence_threshold,
                                   layer_spec=a.layer_spec)
    # DPO's frozen reference: this stage shard's weights, without LoRA's adapters (counted into params below)
    reference = reference_weight_bytes(params_per_gpu=params, training=training, assumptions=a)
    if training.lora is None:
        states = full_model_states(shape=shape, layout=layout, stage=stage, params=params,
                                   expert_params=expert_params, persistent=persistent, assumptions=a, dp_rank=dp_rank)
    else:
        states, params = lora_model_states(shape=shape, layout=layout, lora=training.lora, base_params=params,
                                           persistent=persistent, assumptions=a, stage=stage,
                                           expert_params=expert_params)
    in_flight = micro_batches_in_flight(layout=layout, num_micro=num_micro_batches(layout=layout, training=training),
                                        stage=stage)
    activations = stage_activations(shape=shape, layout=layout, training=training, assumptions=a, stage=stage,
                                    in_flight=in_flight)
    buffers = _buffer_bytes(shape=shape, layout=layout, params=params, assumptions=a)
    subtotal = sum(states.values()) + reference + activations + buffers
    overhead = int(a.framework_overhead_gb * 1e9 + a.fragmentation_fraction * subtotal)
    build_peak = build_peak_bytes(shape=shape, layout=layout, stage=stage, assumptions=a) + reference
    return StageMemory(stage=stage, activations=activations, buffers=buffers, overhead=overhead,
                       params_per_gpu=params, micro_batches_in_flight=in_flight, expert_params_per_gpu=expert_params,
                       build_peak=build_peak, reference=reference, **states)


def stage_activations(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, assumptions: Assumptions,
                      stage: int, in_flight: float) -> int:
    """Activation bytes of one GPU of `stage` at its peak: the policy's for `in_flight` micro-batches, counted in
    rows of seq_length (DPO: dpo.row_layout), or a live DPO reference's forward transient where larger (it runs
    before the policy holds anything: toolkit/plan/dpo.py); the score buffer serves both."""
    a, rows = assumptions, row_layout(layout=layout, training=training)
    held = int(stage_activation_bytes(shape=shape, layout=rows, training=training, assumptions=a,
                                      stage=stage) * in_flight)
    if layout.recompute != "none":  # backward re-runs one layer (its attention core) and holds what it keeps again
        held += _recomputed_layer_bytes(shape=shape, layout=rows, training=training, assumptions=a, stage=stage)
    if stage == layout.pp - 1:
        held += output_layer_activation_bytes(shape=shape, layout=rows, training=training, assumptions=a)
    if stage == 0:
        held += int(embedding_activation_bytes(layout=rows, training=training) * in_flight)
    reference = reference_forward_bytes(shape=shape, layout=rows, training=training, assumptions=a, stage=stage)
    return max(held, reference) + score_buffer_bytes(shape=shape, layout=rows, training=training, assumptions=a)


def full_model_states(*, shape: ModelShape, layout: PlanLayout, stage: int, params: int, expert_params: int,
                      persistent: int, assumptions: Assumptions, dp_rank: int | None = None) -> dict[str, int]:
    """Model-state bytes of full training: DeepSpeed's buffers for the dense parameters, partitioned over dp × cp,
    and for an MoE model's experts (a parameter group of their own), partitioned over expert_dp."""
    a = assumptions
    overlap = (partition_overlap_params(shape=shape, layout=layout, stage=stage, dp_rank=dp_rank,
                                        layer_spec=a.layer_spec)
               if a.precision == "fp32" and layout.zero_stage in (1, 2) else None)  # only these lists hold it
    states = model_state_bytes(num_params=params - expert_params, dp=layout.zero_size, zero_stage=layout.zero_stage,
                               offload_optimizer=layout.offload_optimizer, persistent_params=persistent,
                               overlap_params=overlap, assumptions=a)
    if expert_params == 0:
        return states
    experts = model_state_bytes(num_params=expert_params, dp=layout.expert_dp, zero_stage=layout.zero_stage,
                                offload_optimizer=layout.offload_optimizer, assumptions=a)
    return {category: states[category] + experts[category] for category in states}


def lora_model_states(*, shape: ModelShape, layout: PlanLayout, lora, base_params: int, persistent: int,
                      assumptions: Assumptions, stage: int = 0, expert_params: int = 0) -> tuple[dict[str, int], int]:
    """(model-state bytes, parameters per GPU) with LoRA (toolkit/plan/lora.py): DeepSpeed's buffers for the
    adapter matrices only, plus the frozen base weights at their working width (ZeRO-3: this rank's partition and
    the persistent norms). The stage's adapters are this GPU's (its layers; the routed experts' of its E / ep
    experts): the routed experts' partitioned over expert_dp like their base weights (`expert_params` of
    `base_params`), the rest over dp × cp. At ZeRO-3 the adapters are counted partitioned; DeepSpeed keeps those
    below its persistence threshold whole (rank × hidden elements each: megabytes, not counted)."""
    from toolkit.plan.lora import stage_lora_params, trained_embedding_params

    adapters = stage_lora_params(shape=shape, lora=lora, layout=layout, stage=stage)
    # trained embeddings (train_embeddings) get DeepSpeed's buffers too; their weights are in base_params already
    trained = adapters.dense + trained_embedding_params(shape=shape, lora=lora, tp=layout.tp, pp=layout.pp,
                                                        stage=stage)
    states = model_state_bytes(num_params=trained, dp=layout.zero_size, zero_stage=layout.zero_stage,
                               offload_optimizer=layout.offload_optimizer, assumptions=assumptions)
    if adapters.experts:
        experts = model_state_bytes(num_params=adapters.experts, dp=layout.expert_dp, zero_stage=layout.zero_stage,
                                    offload_optimizer=layout.offload_optimizer, assumptions=assumptions)
        states = {category: states[category] + experts[category] for category in states}
    held = base_params
    if layout.zero_stage >= 3:  # the frozen experts partitioned over expert_dp, the rest over dp × cp
        held = (-(-(base_params - expert_params) // layout.zero_size) + persistent
                + -(-expert_params // layout.expert_dp))
    states["parameters"] += assumptions.param_bytes * held
    return states, base_params + adapters.total


def _layer_bytes(*, shape, layout, training, recompute, assumptions, moe: bool | None = None,
                 mixer: str = ATTENTION) -> int:
    return activation_bytes_per_layer(
        shape=shape, seq_length=training.seq_length, micro_batch_size=layout.micro_batch_size, tp=layout.tp,
        sequence_parallel=layout.sp, recompute=recompute, assumptions=assumptions, cp=layout.cp, ep=layout.ep,
        moe=moe, mixer=mixer)


def _recomputed_layer_bytes(*, shape, layout, training, assumptions, stage: int) -> int:
    """What backward's re-run of one layer holds beyond what the layer keeps (the larger of the stage's kinds)."""
    kinds = stage_layer_kinds(shape=shape, layout=layout, stage=stage)
    return max(max(0, _layer_bytes(shape=shape, layout=layout, training=training, recompute="none",
                                   assumptions=assumptions, moe=moe, mixer=mixer)
                   - _layer_bytes(shape=shape, layout=layout, training=training, recompute=layout.recompute,
                                  assumptions=assumptions, moe=moe, mixer=mixer)) for moe, mixer in kinds)


def stage_activation_bytes(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape,
                           assumptions: Assumptions = DEFAULT_ASSUMPTIONS, stage: int = 0) -> int:
    """One micro-batch's stored activations of a whole stage's layers (the unit micro_batches_in_flight counts)."""
    layers = sum(count * _layer_bytes(shape=shape, layout=layout, training=training, recompute=layout.recompute,
                                      assumptions=assumptions, moe=moe, mixer=mixer)
                 for (moe, mixer), count in stage_layer_kinds(shape=shape, layout=layout, stage=stage).items())
    rope = ROPE_FREQ_BYTES * training.seq_length // layout.cp * shape.rope_dim if layout.recompute == "full" else 0
    return layers + rope


def embedding_activation_bytes(*, layout: PlanLayout, training: TrainingShape) -> int:
    """The vocab-parallel embedding (tp > 1) keeps its shifted token ids (int64) and their out-of-range mask."""
    return 9 * training.seq_length // layout.cp * layout.micro_batch_size if layout.tp > 1 else 0


def score_buffer_bytes(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape,
                       assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> int:
    """Local attention computes its scores into megatron's GlobalMemoryBuffer (`get_tensor(..., "mpu")` in
    dot_product_attention.py): one [b·a, s, s] tensor per rank, allocated once and reused by every layer."""
    if assumptions.attention != "local":
        return 0
    heads, _ = heads_per_rank(shape=shape, tp=layout.tp)
    s = training.seq_length
    return assumptions.activation_bytes * heads * (s // layout.cp) * s * layout.micro_batch_size


def largest_gathered_params(*, shape: ModelShape, tp: int, layer_spec: str = "te") -> int:
    """The largest unit ZeRO-3 gathers at once on one TP rank: a layer (all its experts) or the embedding
    (DeepSpeed's 'largest_layer_params')."""
    embedding = padded_vocab_size(shape=shape, tp=tp) // tp * shape.hidden_size
    return max(embedding, *(layer_params_per_gpu(shape=shape, tp=tp, moe=moe, layer_spec=layer_spec, mixer=mixer)
                            for moe, mixer in shape.layer_kinds()))


def build_peak_bytes(*, shape: ModelShape, layout: PlanLayout, stage: int,
                     assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> int:
    """Device bytes while the chunks are built and loaded, before training allocates anything else.

    ZeRO-3 (toolkit/adapters/zero3.py): zero.Init partitions each module's parameters as soon as that module (a
    linear, a norm, the embedding) is built, and the checkpoint is written one gathered parameter at a time, so a
    rank holds its partition and at most its largest parameter tensor whole (persistent parameters are gathered
    for good only once training fetches them). Other stages build the whole weights."""
    a = assumptions
    tensors = stage_tensors(shape=shape, layout=layout, stage=stage, layer_spec=a.layer_spec)
    params = sum(numel * count for _, numel, count in tensors)
    held = params if layout.zero_stage < 3 else -(-params // layout.zero_size) + max(numel for _, numel, _ in tensors)
    return held * a.param_bytes + int(a.framework_overhead_gb * 1e9)


def _buffer_bytes(*, shape, layout, params, assumptions) -> int:
    """Communication buffers of the step (reported apart from the model states; not in the 5 % live check).

    DeepSpeedZeroOptimizer (fp32 ZeRO-1/2, 16-bit ZeRO-2) allocates whole reduce buckets of reduce_bucket_size
    elements in the weights' dtype, two with overlap_comm (`setup_buckets`, stage_1_and_2.py). ZeRO-3 keeps one fp32
    bucket, the gathered largest unit with its gradient and the prefetch bucket (DeepSpeed's 4 x largest_layer).
    ZeRO-0 and BF16_Optimizer all-reduce through a flat fp32 copy of up to 5e8 elements (the engine's
    MEMORY_OPT_ALLREDUCE_SIZE, `buffered_allreduce_fallback`)."""
    a, stage = assumptions, layout.zero_stage
    if stage == 3:
        largest = largest_gathered_params(shape=shape, tp=layout.tp, layer_spec=a.layer_spec)
        return (a.reduce_bucket_elements * 4 + largest * (a.param_bytes + a.grad_bytes)
                + min(a.zero3_prefetch_elements, params) * a.param_bytes)
    if stage == 2 or (stage == 1 and a.precision == "fp32"):
        overlap = a.overlap_comm and layout.pp == 1  # the engine turns overlap_comm off at pp > 1 (engine_config)
        return (2 if overlap else 1) * a.reduce_bucket_elements * a.param_bytes
    return min(500_000_000, params) * 4


def _require_computable(*, shape: ModelShape, layout: PlanLayout) -> None:
    """The few rules without which the arithmetic is meaningless; `layout_violations` checks the rest."""
    if min(layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch_size) < 1:
        raise DsmtError(f"tp, pp, dp, vpp and micro_batch_size must be >= 1, got {layout.label()}")
    if shape.num_layers % (layout.pp * layout.vpp):
        valid = [d for d in range(1, shape.num_layers + 1) if shape.num_layers % d == 0]
        raise DsmtError(f"pp({layout.pp}) * vpp({layout.vpp}) does not divide num_layers={shape.num_layers}; "
                        f"valid pp * vpp: {', '.join(map(str, valid))}")
    if layout.recompute not in RECOMPUTE_CHOICES:
        raise DsmtError(f"recompute={layout.recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)}")
    require_expert_layout(shape=shape, layout=layout)


def require_fit(memory: MemoryBreakdown) -> None:
    """Raise a DsmtError naming the worst stage's breakdown and the usual fixes when `memory` does not fit."""
    if memory.fits:
        return
    parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in memory.by_category().items())
    build = (f"; building the model needs {memory.build_peak_bytes / 1e9:.1f} GB"
             if memory.build_peak_bytes > memory.total_bytes else "")
    raise DsmtError(
        f"the layout needs {memory.total_bytes / 1e9:.1f} GB per GPU on pipeline stage {memory.worst.stage} "
        f"({parts} GB){build} but the GPU has {memory.capacity_bytes / 1e9:.1f} GB; raise tp or pp, use ZeRO-1 or "
        "higher, recompute activations, lower micro_batch_size, or run `dsmt plan` for layouts that fit")


def estimate_memory(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, gpu: GpuSpec,
                    assumptions: Assumptions = DEFAULT_ASSUMPTIONS, all_stages: bool = False) -> MemoryBreakdown:
    """Memory per GPU for `layout`; the worst pipeline stage decides.

    Only the first and last stages can be the worst (the first holds the most micro-batches and the embedding,
    the last the output layer and logits), and in a model with dense layers the first stage of each other mix of
    dense and MoE layers (toolkit/plan/layers.py `representative_stages`): only they are computed unless `all_stages`.
    """
    _require_computable(shape=shape, layout=layout)
    indices = range(layout.pp) if all_stages else representative_stages(shape=shape, layout=layout)
    stages = tuple(stage_memory(shape=shape, layout=layout, training=training, stage=i, assumptions=assumptions)
                   for i in indices)
    worst = max(stages, key=lambda m: m.total_bytes)
    return MemoryBreakdown(worst=worst, stages=stages, capacity_bytes=gpu.memory_bytes)
