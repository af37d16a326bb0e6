"""The parallel layout: one value used by verify, train, check, generate and plan.

Ranks are laid out as megatron-core does (tp fastest, then cp, dp, pp); the world is tp × cp × dp × pp. Expert
parallelism (ep) lies inside the data-parallel ranks (megatron's expert grid is etp × ep × edp × pp with the expert
TP size etp = tp), so it does not change the world size: each expert lives on one of ep consecutive groups of tp
ranks, and is replicated over edp = dp × cp / ep of them (the expert-data-parallel group).
The short names follow torchtitan's ParallelDims (tp, pp, cp, dp). Which layouts are valid is decided in
one place, `toolkit/parallel/rules.py`.
"""

from __future__ import annotations

import dataclasses


def divisors(n: int) -> list[int]:
    """1..n values dividing n: the candidates every layout rule lists as valid choices."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int = 1  # tensor parallel: each layer's matmuls split over tp ranks
    pp: int = 1  # pipeline stages
    dp: int = 1  # data-parallel replicas (ZeRO partitions over these)
    vpp: int = 1  # model chunks per pipeline stage (interleaved 1F1B when > 1)
    cp: int = 1  # context parallel: the sequence split over cp ranks (ring attention)
    ep: int = 1  # expert parallel (MoE models), inside dp × cp
    sp: bool = False  # sequence parallel: norms / dropout regions split over the tp ranks

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica's shards (tp × cp × pp)."""
        return self.tp * self.cp * self.pp

    @property
    def zero_size(self) -> int:
        """Ranks that hold one parameter's replicas: gradients are reduced and ZeRO states partitioned over dp × cp
        (the CP ranks of a replica see different tokens of the same weights; toolkit/parallel/mpu.py)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks that hold one expert's replicas: its gradients are reduced and ZeRO states partitioned over them."""
        return self.dp * self.cp // self.ep

    def parallel_label(self) -> str:
        parts = [f"tp={self.tp}"] + (["sp"] if self.sp else []) + [f"pp={self.pp}"]
        parts += [f"vpp={self.vpp}"] if self.vpp > 1 else []
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        return " ".join(parts + [f"dp={self.dp}"])

    def parallel_fields(self) -> dict:
        """The topology alone (a subclass's batch or ZeRO fields left out)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(Layout)}
