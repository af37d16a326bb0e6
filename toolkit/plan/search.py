"""Search every valid layout for a model on a cluster, rank those that fit by predicted step time.

The validity rules are the ones `dsmt check` enforces on a job spec (megatron-core's divisibility rules, the
batch identity DeepSpeed asserts, and dsmt's refusal of ZeRO-2/3 under pipeline parallelism).
"""

from __future__ import annotations

import dataclasses
import itertools

from toolkit.errors import DsmtError
from toolkit.parallel.layout import Layout, divisors
from toolkit.parallel.rules import (ModelFacts, RunFacts, layout_errors, tp_spans_nodes, valid_ep_sizes,
                                    valid_tp_sizes)
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import RECOMPUTE_CHOICES, Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import DEFAULT_ASSUMPTIONS, VOCAB_DIVISIBLE_BY, MemoryBreakdown, estimate_memory
from toolkit.plan.timing import StepTime, estimate_step_time
from toolkit.models.shapes import ModelShape

MAX_MICRO_BATCH_SIZE = 16
MAX_VPP = 8
# Context parallelism splits a sequence over cp ranks; with fewer tokens per rank its ring exchange is no longer
# hidden behind the attention compute. megatron-core recommends CP for sequences of 8k and more, and NVIDIA's
# published recipes use cp = 2 at 8k (Llama 3 8B / 70B) and none at 4k (Llama 2 70B): at least 4k tokens per rank.
MIN_TOKENS_PER_CP_RANK = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchLimits:
    """What the search may propose (`dsmt plan --zero-stages --max-tp --max-pp --recompute --allow-offload
    --max-mbs`): a user asks the question a published run answered, e.g. `zero_stages=(0,)` for a replicated
    optimizer. The default is every layout the rules accept, ZeRO-1 to 3, no offload. ZeRO-0 keeps the whole
    optimizer on every rank (a bf16 run then accumulates gradients in bf16: the emitted spec says so), so it is
    searched only when asked."""

    zero_stages: tuple[int, ...] = (1, 2, 3)
    max_tp: int | None = None
    max_pp: int | None = None
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    offload: bool = False
    max_micro_batch_size: int = MAX_MICRO_BATCH_SIZE

    def __post_init__(self):
        problems = []
        if not self.zero_stages or not set(self.zero_stages) <= {0, 1, 2, 3}:
            problems.append(f"zero stages {list(self.zero_stages)} must be a non-empty subset of 0, 1, 2, 3")
        if not self.recompute or not set(self.recompute) <= set(RECOMPUTE_CHOICES):
            problems.append(f"recompute {list(self.recompute)} must be a non-empty subset of "
                            f"{', '.join(RECOMPUTE_CHOICES)}")
        for name, flag in (("max_tp", "--max-tp"), ("max_pp", "--max-pp"), ("max_micro_batch_size", "--max-mbs")):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{flag} {value} must be at least 1")
        if problems:
            raise DsmtError("invalid search limits: " + "; ".join(problems))

    def describe(self) -> str:
        """The restrictions that differ from the default, for the plan's header ('' when none)."""
        default, parts = SearchLimits(), []
        if self.zero_stages != default.zero_stages:
            parts.append("zero stages " + ",".join(map(str, self.zero_stages)))
        parts += [f"tp <= {self.max_tp}"] if self.max_tp else []
        parts += [f"pp <= {self.max_pp}"] if self.max_pp else []
        if self.recompute != default.recompute:
            parts.append("recompute " + ",".join(self.recompute))
        parts += ["optimizer offload allowed"] if self.offload else []
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: PlanLayout
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
    fitting: list[Candidate]       # the recommendation order: ties with the fastest simplest first, then by time
    rejected: list[Candidate]      # faster than the fastest fitting but too big; if none fits, the smallest ones
    evaluated: int
    fastest: Candidate | None = None   # the fitting layout with the shortest predicted step
    limits: SearchLimits = SearchLimits()

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    @property
    def preferred_for_simplicity(self) -> bool:
        """True when the choice is not the fastest prediction but a simpler layout within the uncertainty."""
        return self.best is not None and self.fastest is not None and self.best is not self.fastest


# The order of simplicity, most important first: a layout within the time model's uncertainty of the fastest is
# preferred when it is simpler by the first of these that differs (fewer moving parts, less to go wrong).
SIMPLICITY_ORDER = (
    "TP group inside one node",                 # TP across nodes runs its per-layer collectives over InfiniBand
    "fewer pipeline stages",                    # bubble, p2p, stage balance, PP-only failure modes
    "fewer virtual pipeline stages",            # interleaving multiplies p2p traffic and needs m % pp == 0
    "fewer expert-parallel ranks",              # MoE: each EP rank adds token all-to-alls to every layer
    "lower ZeRO stage",                         # ZeRO-2/3 add per-micro-batch traffic and partitioned state
    "less recompute (none, selective, full)",   # recompute spends compute to save memory
    "no optimizer offload",                     # CPU Adam and PCIe transfers
)


def simplicity_key(*, layout: PlanLayout, cluster: Cluster) -> tuple:
    """Sort key following SIMPLICITY_ORDER (smaller is simpler)."""
    return (tp_spans_nodes(tp=layout.tp, gpus_per_node=cluster.gpus_per_node), layout.pp, layout.vpp, layout.ep,
            layout.zero_stage,
            RECOMPUTE_CHOICES.index(layout.recompute), layout.offload_optimizer)


def simplicity_reason(*, simpler: PlanLayout, other: PlanLayout, cluster: Cluster) -> str:
    """The first entry of SIMPLICITY_ORDER in which `simpler` beats `other`."""
    ours, theirs = simplicity_key(layout=simpler, cluster=cluster), simplicity_key(layout=other, cluster=cluster)
    for reason, mine, its in zip(SIMPLICITY_ORDER, ours, theirs):
        if mine != its:
            return reason
    return "equally simple"


def rank_candidates(*, fitting: list[Candidate], cluster: Cluster, uncertainty: float) -> list[Candidate]:
    """Candidates predicted within `uncertainty` of the fastest are ties the model cannot separate: they come
    first, simplest first (SIMPLICITY_ORDER, then time); the rest follow by predicted time."""
    if not fitting:
        return []
    by_time = sorted(fitting, key=lambda c: c.time.step_time_s)
    limit = by_time[0].time.step_time_s * (1.0 + uncertainty)
    ties = [c for c in by_time if c.time.step_time_s <= limit]
    ties.sort(key=lambda c: (simplicity_key(layout=c.layout, cluster=cluster), c.time.step_time_s))
    return ties + [c for c in by_time if c.time.step_time_s > limit]


def plan_run_facts(*, layout: PlanLayout, training: TrainingShape, cluster: Cluster,
                   assumptions: Assumptions) -> RunFacts:
    return RunFacts(world_size=cluster.world_size, gpus_per_node=cluster.gpus_per_node,
                    global_batch_size=training.global_batch_size, micro_batch_size=layout.micro_batch_size,
                    seq_length=training.seq_length, zero_stage=layout.zero_stage, device="cuda",
                    attention=assumptions.attention)


def layout_violations(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, cluster: Cluster,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> list[str]:
    """Every rule `layout` breaks (the one rule set, toolkit/parallel/rules.py), each with the values and a fix."""
    model = ModelFacts.from_shape(shape, vocab_multiple=VOCAB_DIVISIBLE_BY)
    run = plan_run_facts(layout=layout, training=training, cluster=cluster, assumptions=assumptions)
    problems = [f"[{p.rule}] {p.message}; fix: {p.fix}" for p in layout_errors(layout=layout, model=model, run=run)]
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage={layout.zero_stage} is not one of 0, 1, 2, 3")
    if layout.offload_optimizer and layout.zero_stage < 1:
        problems.append("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload partitions the optimizer)")
    if layout.recompute not in RECOMPUTE_CHOICES:
        problems.append(f"recompute={layout.recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)}")
    if getattr(training, "dpo", None) is not None and layout.cp > 1:
        problems.append(f"[dpo_context_parallel] DPO with cp={layout.cp}: a sequence's log-prob is summed on one "
                        "rank, and context parallelism splits it; fix: cp=1 (sequence parallelism or a larger tp "
                        "saves activation memory instead)")
    return problems


def evaluate(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, cluster: Cluster,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> Candidate:
    memory = estimate_memory(shape=shape, layout=layout, training=training, gpu=cluster.gpu, assumptions=assumptions)
    time = estimate_step_time(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=assumptions)
    return Candidate(layout=layout, memory=memory, time=time)


def _topologies(*, model: ModelFacts, training: TrainingShape, cluster: Cluster, attention: str, max_vpp: int,
                limits: SearchLimits):
    """(tp, cp, pp, vpp) to search: TP inside a node only (the planner never proposes a TP group across nodes),
    CP only with fused attention and at least MIN_TOKENS_PER_CP_RANK tokens per rank, and not for DPO (a
    sequence's log-prob is summed on one rank: `dsmt check` rule dpo_context_parallel)."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    dpo = getattr(training, "dpo", None) is not None
    for tp in valid_tp_sizes(model=model, limit=min(per_node, limits.max_tp or per_node)):
        if tp_spans_nodes(tp=tp, gpus_per_node=per_node):
            continue
        for cp in divisors(world // tp):
            if cp > 1 and (dpo or attention != "fused" or training.seq_length // cp < MIN_TOKENS_PER_CP_RANK):
                continue
            for pp in divisors(world // (tp * cp)):
                if limits.max_pp and pp > limits.max_pp:
                    continue
                vpps = [v for v in range(1, max_vpp + 1) if v == 1 or (pp > 1 and model.num_layers % (pp * v) == 0)]
                for vpp in vpps:
                    yield tp, cp, pp, vpp


def enumerate_layouts(*, shape: ModelShape, training: TrainingShape, cluster: Cluster,
                      assumptions: Assumptions = DEFAULT_ASSUMPTIONS, limits: SearchLimits = SearchLimits(),
                      max_vpp: int = MAX_VPP):
    """Yield every layout the rules accept (toolkit/parallel/rules.py: the same as `dsmt check` and `dsmt train`),
    without TP groups across nodes. Sequence parallelism is on whenever tp > 1 (megatron-core's recommendation:
    the same communication volume as TP alone, less activation memory; megatron-core needs it for MoE with TP).
    An MoE model is also searched over every ep dividing its experts and dp × cp; a dense one has ep = 1."""
    model = ModelFacts.from_shape(shape, vocab_multiple=VOCAB_DIVISIBLE_BY)
    attention = assumptions.attention
    # Selective recompute drops only the attention core, which fused attention does not store.
    recomputes = [r for r in limits.recompute
                  if not (r == "selective" and attention == "fused" and "none" in limits.recompute)]
    for tp, cp, pp, vpp in _topologies(model=model, training=training, cluster=cluster, attention=attention,
                                       max_vpp=max_vpp, limits=limits):
        dp = cluster.world_size // (tp * cp * pp)
        # Plans are bf16: DeepSpeed keeps fp32 master weights and accumulates gradients in fp32 only under ZeRO
        # (stage 1 is the BF16 optimizer; with nothing to partition it costs what ZeRO-0 would).
        # Without data parallelism the stages partition nothing: one is searched, ZeRO-1 where allowed
        zeros = sorted(limits.zero_stages) if dp * cp > 1 else [1 if 1 in limits.zero_stages
                                                                 else min(limits.zero_stages)]
        eps = valid_ep_sizes(model=model, layout=Layout(dp=dp, cp=cp)) if shape.is_moe else (1,)
        for mbs, zero, ep in itertools.product(range(1, limits.max_micro_batch_size + 1), zeros, eps):
            layout = PlanLayout(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp, ep=ep, sp=tp > 1, zero_stage=zero,
                                micro_batch_size=mbs)
            run = plan_run_facts(layout=layout, training=training, cluster=cluster, assumptions=assumptions)
            if layout_errors(layout=layout, model=model, run=run):
                continue
            for offload, recompute in itertools.product([False, True] if limits.offload and zero else [False],
                                                        recomputes):
                yield dataclasses.replace(layout, recompute=recompute, offload_optimizer=offload)


def plan(*, shape: ModelShape, training: TrainingShape, cluster: Cluster,
         assumptions: Assumptions = DEFAULT_ASSUMPTIONS, limits: SearchLimits = SearchLimits(),
         keep_rejected: int = 5) -> Plan:
    """Evaluate every valid layout; among those that fit, the simplest within the time model's uncertainty of the
    fastest comes first (rank_candidates), the rest by predicted step time."""
    if training.global_batch_size < 1 or training.seq_length < 1:
        raise DsmtError(f"global batch ({training.global_batch_size}) and sequence length "
                        f"({training.seq_length}) must be positive")
    fitting, rejected, evaluated = [], [], 0
    for layout in enumerate_layouts(shape=shape, training=training, cluster=cluster, assumptions=assumptions,
                                    limits=limits):
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
            f"{cluster.world_size}, or change the cluster size"
            + (f" (searched only: {limits.describe()}; relax those limits)" if limits.describe() else ""))
    fastest = min(fitting, key=lambda c: c.time.step_time_s) if fitting else None
    rejected.sort(key=lambda c: c.time.step_time_s)
    if fastest is not None:  # what would win with more memory
        shown = [c for c in rejected if c.time.step_time_s < fastest.time.step_time_s]
    else:  # nothing fits: the layouts closest to fitting
        shown = sorted(rejected, key=lambda c: c.memory.total_bytes)
    ranked = rank_candidates(fitting=fitting, cluster=cluster, uncertainty=assumptions.time_uncertainty)
    return Plan(shape=shape, cluster=cluster, training=training, assumptions=assumptions, fitting=ranked,
                rejected=shown[:keep_rejected], evaluated=evaluated, fastest=fastest, limits=limits)
