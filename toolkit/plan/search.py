"""Search every valid layout for a model on a cluster, rank those that fit by predicted step time.

The validity rules are the ones `dsmt check` enforces on a job spec (megatron-core's divisibility rules, the
batch identity DeepSpeed asserts, and dsmt's refusal of ZeRO-2/3 under pipeline parallelism).
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError
from toolkit.parallel import divisors
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import RECOMPUTE_CHOICES, Cluster, Layout, TrainingShape
from toolkit.plan.memory import DEFAULT_ASSUMPTIONS, MemoryBreakdown, estimate_memory
from toolkit.plan.timing import StepTime, estimate_step_time
from toolkit.shapes import ModelShape

MAX_MICRO_BATCH_SIZE = 16
MAX_VPP = 8


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime

    @property
    def fits(self) -> bool:
        return self.memory.fits


@dataclasses.dataclass(frozen=True)
class Plan:
    shape: ModelShape
    cluster: Cluster
    training: TrainingShape
    assumptions: Assumptions
    fitting: list[Candidate]       # fastest first
    rejected: list[Candidate]      # faster than the best but too big; if none fits, the smallest ones
    evaluated: int

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None


def _valid_values(values, pred) -> str:
    return ", ".join(str(v) for v in values if pred(v)) or "none"


def layout_violations(*, shape: ModelShape, layout: Layout, training: TrainingShape, cluster: Cluster) -> list[str]:
    """Every rule `layout` breaks, each with the values and a fix; empty when valid."""
    problems = []
    world = cluster.world_size
    if layout.world_size != world:
        problems.append(f"tp({layout.tp}) * pp({layout.pp}) * dp({layout.dp}) = {layout.world_size} != "
                        f"world size {world} (nodes x gpus_per_node); set dp = {world // (layout.tp * layout.pp) or 1}")
    for what, count in (("num_attention_heads", shape.num_attention_heads), ("num_kv_heads", shape.num_kv_heads),
                        ("ffn_hidden_size", shape.ffn_hidden_size)):
        if count % layout.tp:
            valid = _valid_values(divisors(min(count, world)), lambda t: count % t == 0 and world % t == 0)
            problems.append(f"tp={layout.tp} does not divide {what}={count}; valid tp: {valid}")
    chunks = layout.pp * layout.vpp
    if shape.num_layers % chunks:
        problems.append(f"pp({layout.pp}) * vpp({layout.vpp}) = {chunks} does not divide num_layers="
                        f"{shape.num_layers}; valid pp*vpp: {_valid_values(divisors(shape.num_layers), bool)}")
    if layout.vpp > 1 and layout.pp < 2:
        problems.append(f"vpp={layout.vpp} needs pp >= 2 (interleaving splits a pipeline stage); set vpp=1")
    per_step = layout.micro_batch_size * layout.dp
    if training.global_batch_size % per_step:
        valid = _valid_values(range(1, MAX_MICRO_BATCH_SIZE + 1),
                              lambda b: training.global_batch_size % (b * layout.dp) == 0)
        problems.append(f"global_batch_size={training.global_batch_size} is not divisible by micro_batch_size("
                        f"{layout.micro_batch_size}) * dp({layout.dp}); valid micro_batch_size: {valid}")
    elif layout.vpp > 1 and (training.global_batch_size // per_step) % layout.pp:
        problems.append(f"the interleaved schedule needs the micro-batch count "
                        f"({training.global_batch_size // per_step}) divisible by pp={layout.pp}; change "
                        "global_batch_size or micro_batch_size, or set vpp=1")
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage={layout.zero_stage} is not one of 0, 1, 2, 3")
    elif layout.zero_stage >= 2 and layout.pp > 1:
        problems.append(f"ZeRO-{layout.zero_stage} with pp={layout.pp} is refused: pipeline parallelism runs many "
                        "micro-batches and ZeRO-2/3 adds data-parallel communication on each one (DeepSpeed "
                        "#1629); use zero_stage=1")
    if layout.offload_optimizer and layout.zero_stage < 1:
        problems.append("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload partitions the optimizer)")
    if layout.recompute not in RECOMPUTE_CHOICES:
        problems.append(f"recompute={layout.recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)}")
    return problems


def evaluate(*, shape: ModelShape, layout: Layout, training: TrainingShape, cluster: Cluster,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> Candidate:
    memory = estimate_memory(shape=shape, layout=layout, training=training, gpu=cluster.gpu, assumptions=assumptions)
    time = estimate_step_time(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=assumptions)
    return Candidate(layout=layout, memory=memory, time=time)


def enumerate_layouts(*, shape: ModelShape, training: TrainingShape, cluster: Cluster,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS, allow_offload: bool = False,
                      max_micro_batch_size: int = MAX_MICRO_BATCH_SIZE, max_vpp: int = MAX_VPP):
    """Yield every valid layout; invalid combinations are pruned by the same rules as layout_violations."""
    world = cluster.world_size
    recomputes = [r for r in RECOMPUTE_CHOICES if not (r == "selective" and assumptions.flash_attention)]
    for tp in divisors(world):
        if shape.num_attention_heads % tp or shape.num_kv_heads % tp or shape.ffn_hidden_size % tp:
            continue
        for pp in divisors(world // tp):
            if shape.num_layers % pp:
                continue
            dp = world // (tp * pp)
            if training.global_batch_size % dp:
                continue
            vpps = [1] + [v for v in range(2, max_vpp + 1) if pp > 1 and shape.num_layers % (pp * v) == 0]
            # Plans are bf16: DeepSpeed keeps fp32 master weights and accumulates gradients in fp32 only under ZeRO
            # (stage 1 is the BF16 optimizer; at dp = 1 it partitions nothing and costs what ZeRO-0 would).
            zeros = [1] if dp == 1 or pp > 1 else [1, 2, 3]
            for mbs in range(1, max_micro_batch_size + 1):
                if training.global_batch_size % (mbs * dp):
                    continue
                num_micro = training.global_batch_size // (mbs * dp)
                for vpp in vpps:
                    if vpp > 1 and num_micro % pp:
                        continue
                    for zero in zeros:
                        for offload in ([False, True] if allow_offload and zero >= 1 else [False]):
                            for recompute in recomputes:
                                yield Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, zero_stage=zero, micro_batch_size=mbs,
                                             recompute=recompute, offload_optimizer=offload)


def plan(*, shape: ModelShape, training: TrainingShape, cluster: Cluster,
         assumptions: Assumptions = DEFAULT_ASSUMPTIONS, allow_offload: bool = False, keep_rejected: int = 5,
         max_micro_batch_size: int = MAX_MICRO_BATCH_SIZE) -> Plan:
    """Evaluate every valid layout; ranked by predicted step time among those that fit."""
    if training.global_batch_size < 1 or training.seq_length < 1:
        raise DsmtError(f"global batch ({training.global_batch_size}) and sequence length "
                        f"({training.seq_length}) must be positive")
    fitting, rejected, evaluated = [], [], 0
    for layout in enumerate_layouts(shape=shape, training=training, cluster=cluster, assumptions=assumptions,
                                    allow_offload=allow_offload, max_micro_batch_size=max_micro_batch_size):
        candidate = evaluate(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=assumptions)
        (fitting if candidate.fits else rejected).append(candidate)
        evaluated += 1
    if evaluated == 0:
        dps = [d for d in divisors(cluster.world_size) if training.global_batch_size % d == 0]
        raise DsmtError(
            f"no valid layout: global_batch_size={training.global_batch_size} must be divisible by "
            f"micro_batch_size * dp, with tp dividing heads ({shape.num_attention_heads}) and KV heads "
            f"({shape.num_kv_heads}) and pp dividing num_layers ({shape.num_layers}); data-parallel sizes this "
            f"batch allows: {', '.join(map(str, dps)) or 'none'}. Choose a global batch that is a multiple of "
            f"{cluster.world_size}, or change the cluster size")
    fitting.sort(key=lambda c: c.time.step_time_s)
    rejected.sort(key=lambda c: c.time.step_time_s)
    if fitting:  # what would win with more memory
        shown = [c for c in rejected if c.time.step_time_s < fitting[0].time.step_time_s]
    else:  # nothing fits: the layouts closest to fitting
        shown = sorted(rejected, key=lambda c: c.memory.total_bytes)
    return Plan(shape=shape, cluster=cluster, training=training, assumptions=assumptions, fitting=fitting,
                rejected=shown[:keep_rejected], evaluated=evaluated)
