"""The values a plan is made of: a parallel layout, the training shape, the cluster."""

from __future__ import annotations

import dataclasses

from toolkit.plan.hardware import GpuSpec

RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1                       # virtual pipeline stages (model chunks) per pipeline rank
    zero_stage: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"            # one of RECOMPUTE_CHOICES
    sequence_parallel: bool | None = None  # None: on whenever tp > 1 (megatron-core's recommendation)
    offload_optimizer: bool = False    # ZeRO-Offload: optimizer states and fp32 gradients on the CPU

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel and self.tp > 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        parts += [f"dp={self.dp}", f"zero={self.zero_stage}", f"mbs={self.micro_batch_size}",
                  f"recompute={self.recompute}"]
        if self.tp > 1 and not self.sp:
            parts.append("sp=off")
        if self.offload_optimizer:
            parts.append("offload")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class TrainingShape:
    seq_length: int
    global_batch_size: int


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def num_micro_batches(*, layout: Layout, training: TrainingShape) -> int:
    """Micro-batches per step per data-parallel rank (global = micro x dp x accumulation steps)."""
    return max(1, training.global_batch_size // (layout.micro_batch_size * layout.dp))
