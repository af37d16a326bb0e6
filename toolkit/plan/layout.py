"""The values a plan is made of: a parallel layout, the training shape, the cluster."""

from __future__ import annotations

import dataclasses

from toolkit.parallel.layout import Layout
from toolkit.plan.dpo import DpoShape  # noqa: F401  (TrainingShape.dpo)
from toolkit.plan.hardware import GpuSpec
from toolkit.plan.lora import LoraShape  # noqa: F401  (TrainingShape.lora)

RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanLayout(Layout):
    """A parallel layout with the choices the planner makes for it (sp is a plain choice: the planner proposes it
    with tp > 1, and the emitted spec carries it)."""

    zero_stage: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"            # one of RECOMPUTE_CHOICES
    offload_optimizer: bool = False    # ZeRO-Offload: optimizer states and fp32 gradients on the CPU

    def label(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"vpp={self.vpp}"] if self.vpp > 1 else []
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += [f"dp={self.dp}", f"zero={self.zero_stage}", f"mbs={self.micro_batch_size}",
                  f"recompute={self.recompute}"]
        if self.sp:
            parts.append("sp")
        if self.offload_optimizer:
            parts.append("offload")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class TrainingShape:
    seq_length: int
    global_batch_size: int
    lora: "LoraShape | None" = None  # toolkit/plan/lora.py; None: full fine-tuning
    # toolkit/plan/dpo.py; None: SFT. With DPO global_batch_size and micro_batch_size count pairs
    dpo: "DpoShape | None" = None


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def num_micro_batches(*, layout: PlanLayout, training: TrainingShape) -> int:
    """Micro-batches per step per data-parallel rank (global = micro x dp x accumulation steps)."""
    return max(1, training.global_batch_size // (layout.micro_batch_size * layout.dp))
