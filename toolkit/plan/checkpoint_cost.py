"""What saving a checkpoint costs at a layout (`dsmt plan`): its size, each rank's host memory while it saves, and
the time to write it.

dsmt's checkpoint (toolkit/train/checkpoint/) keeps the fp32 master weights and Adam's two moments of every
trainable parameter, 12 bytes each (the ZeRO paper's K, Rajbhandari et al. 2020), plus one small RNG file per rank
and a few JSON records; the 16-bit working weights are not saved (they are the master rounded), nor, with LoRA, the
frozen base weights (they come from the HF model): then only the adapters train, and the embeddings with
train_embeddings. Each rank writes its own ZeRO share of those states, at any ZeRO stage: 1 / (tp x pp x cp x dp)
of them on average (a pipeline stage holding an embedding holds a little more), staged in host memory first, so
that share is what a save adds to the rank's host memory (benchmarks/checkpoint_cost.py measures it per rank). The
ranks of a node write at once through the node's one link to the filesystem: a save takes the node's bytes over
the per-node write bandwidth `Assumptions.checkpoint_write_gbps`.
"""

from __future__ import annotations

import dataclasses

from toolkit.models.shapes import ModelShape
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.units import bytes_text, count_text

STATE_BYTES_PER_TRAINABLE = 12  # fp32 master weight + exp_avg + exp_avg_sq
# torch.save of a rank's RNG states (torch, numpy, python; megatron's CUDA tracker and CUDA's generator on a GPU):
# 15,837 bytes measured on CPU (benchmarks/checkpoint_cost.py), a GPU rank adds a few hundred bytes of CUDA states
RNG_FILE_BYTES = 16_000


@dataclasses.dataclass(frozen=True)
class CheckpointCost:
    trainable_params: int
    total_bytes: int        # the states of every trainable parameter and every rank's RNG file
    rank_bytes: int         # one rank's share of the states: what its save stages in host memory
    ranks_per_node: int
    write_gbps: float       # the assumed write bandwidth of one node
    write_s: float          # a node's ranks' shares at that bandwidth

    def as_dict(self) -> dict:
        return {"trainable_params": self.trainable_params, "total_gb": round(self.total_bytes / 1e9, 3),
                "rank_host_memory_gb": round(self.rank_bytes / 1e9, 3), "ranks_per_node": self.ranks_per_node,
                "write_s": round(self.write_s, 2), "assumed_write_gbps_per_node": self.write_gbps}


def trainable_params(*, shape: ModelShape, training: TrainingShape) -> int:
    """Parameters the optimizer updates: every one in a full fine-tune; with LoRA the adapters (every layer's,
    every expert's) and, with train_embeddings, the input embedding and an untied output layer."""
    from toolkit.plan.lora import lora_params

    if training.lora is None:
        return shape.num_params()
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tied_embeddings else 2)
    return lora_params(shape=shape, lora=training.lora) + (embeddings if training.lora.train_embeddings else 0)


def checkpoint_cost(*, shape: ModelShape, layout: PlanLayout, training: TrainingShape, cluster: Cluster,
                    assumptions: Assumptions) -> CheckpointCost:
    """The checkpoint of a run of `shape` at `layout` on `cluster`."""
    params = trainable_params(shape=shape, training=training)
    states = STATE_BYTES_PER_TRAINABLE * params
    ranks = layout.tp * layout.pp * layout.cp * layout.dp
    rank_bytes = -(-states // ranks)
    ranks_per_node = min(cluster.gpus_per_node, ranks)
    write_s = rank_bytes * ranks_per_node / (assumptions.checkpoint_write_gbps * 1e9)
    return CheckpointCost(trainable_params=params, total_bytes=states + ranks * RNG_FILE_BYTES,
                          rank_bytes=rank_bytes, ranks_per_node=ranks_per_node,
                          write_gbps=assumptions.checkpoint_write_gbps, write_s=write_s)


def checkpoint_lines(cost: CheckpointCost, *, indent: str = "", label: str = "checkpoint") -> list[str]:
    """The figures as `dsmt plan` prints them, the bandwidth named as the assumption it is."""
    ranks = f"{cost.ranks_per_node} ranks" if cost.ranks_per_node > 1 else "one rank"
    return [f"{indent}{label}: {bytes_text(cost.total_bytes)} = 12 bytes (fp32 master + 2 Adam moments) x "
            f"{count_text(cost.trainable_params)} trainable parameters, + an RNG file per rank",
            f"{indent}  save: each rank stages its share in host memory, {bytes_text(cost.rank_bytes)}; ~"
            f"{cost.write_s:.3g} s to write ({ranks} per node, {bytes_text(cost.rank_bytes * cost.ranks_per_node)}, "
            f"at an assumed {cost.write_gbps:g} GB/s per node to the filesystem: --checkpoint-write-gbps)"]


def plan_checkpoint(result) -> CheckpointCost | None:
    """The checkpoint of the plan's choice (`result`: a search.Plan); None when no layout fits."""
    if result.best is None:
        return None
    return checkpoint_cost(shape=result.shape, layout=result.best.layout, training=result.training,
                           cluster=result.cluster, assumptions=result.assumptions)


SAVE_WAIT_FACTOR = 3  # a parallel filesystem under other jobs' load writes several times slower than its peak
SAVE_WAIT_MARGIN_S = 60.0  # the index, the manifest and the rename after the writes, and a slow start


def save_wait_s(*, trainable_params: int, ranks: int, ranks_per_node: int,
                write_gbps: float = Assumptions.checkpoint_write_gbps) -> float:
    """How long a rank may wait in a collective for the slowest writer of a save (the completion of a foreground
    save, or of a background one that the next save waits for): SAVE_WAIT_FACTOR x a node's estimated write, plus
    SAVE_WAIT_MARGIN_S. `dsmt train` makes the collective timeout at least this (toolkit/train/job/run.py)."""
    node_bytes = STATE_BYTES_PER_TRAINABLE * trainable_params / max(1, ranks) * ranks_per_node
    return SAVE_WAIT_FACTOR * node_bytes / (write_gbps * 1e9) + SAVE_WAIT_MARGIN_S

