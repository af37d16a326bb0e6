"""One published training run: the cluster, batch and layout it ran and the utilisation it measured
(toolkit/plan/published.py, published_sharded.py hold the rows)."""

from __future__ import annotations

import dataclasses

from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.models.shapes import ModelShape


def gpt_shape(name: str, hidden: int, layers: int, heads: int, vocab: int = 51200) -> ModelShape:
    """A GPT-3 style model as these papers define it: ffn = 4h, GeLU, tied embeddings."""
    return ModelShape(name, hidden, layers, heads, heads, 4 * hidden, vocab, True, False, 2048)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published run: the cluster and batch (the planner's inputs) and the layout the authors chose."""

    source: str
    model: str                      # a key of BUILTIN_SHAPES or PAPER_SHAPES
    gpu: str                        # GPU preset (toolkit/plan/hardware.py)
    num_gpus: int
    global_batch: int               # sequences per optimizer step
    seq_length: int
    tp: int
    pp: int
    cp: int = 1
    vpp: int = 1
    micro_batch_size: int = 1       # 1 where the source does not say
    sequence_parallel: bool = True  # with tp > 1; Korthikanti et al. 2022 introduced it, earlier runs lack it
    interleaved_unpublished: bool = False   # interleaved schedule whose virtual-stage count the source omits
    # What data parallelism sharded: 0 nothing (every replica held the optimizer: Megatron-LM 2021), 1 the
    # optimizer (ZeRO-1, megatron's distributed optimizer), 2 also gradients (ZeRO-2, FSDP SHARD_GRAD_OP), 3 also
    # parameters (ZeRO-3, FSDP FULL_SHARD); None where the source is silent (timed as 1).
    zero_stage: int | None = 1
    engine: str = "megatron"        # what sends the data-parallel traffic: megatron, deepspeed or fsdp
    recompute: str | None = None    # what the run recomputed; None where the source is silent (timed as none)
    precision: str = "bf16"
    gpus_per_node: int = 8
    ib_gbps: float | None = None    # network GB/s per GPU per direction where it differs from the GPU preset's
    attention: str = "fused"        # fused (flash / cuDNN) or local (unfused softmax, s x s scores in memory)
    dropout: bool = False
    grad_comm_bytes: int = 4        # bytes per gradient element reduced over data parallelism
    # Measured utilisation of the bf16 peak: "mfu" counts model FLOPs only, "hfu" also the recomputed forward
    # (Narayanan's TFLOP/s). None where the source gives none or the run was not bf16.
    utilisation: float | None = None
    utilisation_kind: str = "mfu"
    note: str = ""
    known_gap: str = ""             # why the time model misses this row by more than 20 % (calibration.py)

    @property
    def sharded_optimizer(self) -> bool | None:
        """Optimizer state partitioned over data parallelism, as the planner assumes by default."""
        return None if self.zero_stage is None else self.zero_stage >= 1

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.cp * self.pp)

    @property
    def label(self) -> str:
        return f"{self.model} on {self.num_gpus} {self.gpu}"

    def cluster(self) -> Cluster:
        gpu = get_gpu(self.gpu)
        if self.ib_gbps is not None:
            gpu = dataclasses.replace(gpu, ib_gbps=self.ib_gbps)
        return Cluster(nodes=self.num_gpus // self.gpus_per_node, gpus_per_node=self.gpus_per_node, gpu=gpu)

    def training(self) -> TrainingShape:
        return TrainingShape(seq_length=self.seq_length, global_batch_size=self.global_batch)

    def layout(self) -> PlanLayout:
        """The published layout (ZeRO-1 where the source does not say what was sharded)."""
        return PlanLayout(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, vpp=self.vpp,
                          sp=self.sequence_parallel and self.tp > 1,
                          zero_stage=1 if self.zero_stage is None else self.zero_stage,
                          micro_batch_size=self.micro_batch_size, recompute=self.recompute or "none")


