"""The checkpoint figures of `dsmt plan` (toolkit/plan/checkpoint_cost.py): size, each rank's save host memory and
the save time at the assumed per-node write bandwidth, in the table, --explain and --json."""

from __future__ import annotations

import dataclasses
import json

import pytest

from toolkit.cli import main
from toolkit.errors import DsmtError
from toolkit.models.shapes import BUILTIN_SHAPES
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.checkpoint_cost import RNG_FILE_BYTES, checkpoint_cost
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.lora import LoraShape

LLAMA8 = BUILTIN_SHAPES["llama3-8b"]
TWO_NODES = Cluster(nodes=2, gpus_per_node=8, gpu=get_gpu("h100-80gb"))
TRAIN = TrainingShape(seq_length=4096, global_batch_size=256)
TP2_DP8 = PlanLayout(tp=2, pp=1, dp=8, zero_stage=1, micro_batch_size=1)
BASE = ["plan", "llama3-8b", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--seq-len", "4096",
        "--global-batch", "256"]


def test_full_fine_tune_of_8b_at_tp2_dp8():
    cost = checkpoint_cost(shape=LLAMA8, layout=TP2_DP8, training=TRAIN, cluster=TWO_NODES, assumptions=Assumptions())
    assert cost.trainable_params == LLAMA8.num_params() == 8_030_261_248
    assert cost.total_bytes == 12 * 8_030_261_248 + 16 * RNG_FILE_BYTES  # ~96.4 GB
    assert cost.rank_bytes == 12 * 8_030_261_248 // 16  # ~6.0 GB: each of the 16 ranks writes its share
    # the 8 ranks of a node write 48.2 GB through the node's link at the assumed 2 GB/s
    assert cost.ranks_per_node == 8 and cost.write_s == pytest.approx(8 * cost.rank_bytes / 2e9)
    faster = checkpoint_cost(shape=LLAMA8, layout=TP2_DP8, training=TRAIN, cluster=TWO_NODES,
                             assumptions=Assumptions(checkpoint_write_gbps=8.0))
    assert faster.write_s == pytest.approx(cost.write_s / 4)


def test_lora_saves_the_adapters_and_trained_embeddings():
    lora = TrainingShape(seq_length=4096, global_batch_size=256, lora=LoraShape(rank=16))
    cost = checkpoint_cost(shape=LLAMA8, layout=TP2_DP8, training=lora, cluster=TWO_NODES, assumptions=Assumptions())
    assert cost.trainable_params == 41_943_040  # PEFT's count for r=16 on every linear (test_lora_plan.py)
    with_embeddings = dataclasses.replace(lora, lora=LoraShape(rank=16, train_embeddings=True))
    cost = checkpoint_cost(shape=LLAMA8, layout=TP2_DP8, training=with_embeddings, cluster=TWO_NODES,
                           assumptions=Assumptions())
    assert cost.trainable_params == 41_943_040 + 2 * 128_256 * 4096  # untied: the input embedding and the output


def test_a_run_smaller_than_a_node():
    one_node = Cluster(nodes=1, gpus_per_node=8, gpu=get_gpu("h100-80gb"))
    layout = PlanLayout(tp=1, pp=1, dp=2, zero_stage=1, micro_batch_size=1)
    cost = checkpoint_cost(shape=LLAMA8, layout=layout, training=TRAIN, cluster=one_node, assumptions=Assumptions())
    assert cost.ranks_per_node == 2 and cost.rank_bytes == 6 * 8_030_261_248


def test_bandwidth_must_be_positive():
    with pytest.raises(DsmtError, match="checkpoint_write_gbps=0.0 must be positive"):
        Assumptions(checkpoint_write_gbps=0.0)


def test_plan_prints_the_choice_checkpoint(capsys):
    assert main(BASE + ["--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint of #1: 96.4 GB = 12 bytes (fp32 master + 2 Adam moments) x 8.03 B trainable" in out
    assert "at an assumed 2 GB/s per node to the filesystem" in out
    assert main(BASE + ["--explain", "tp=2 pp=1 zero=1 mbs=1", "--checkpoint-write-gbps", "4"]) == 0
    out = capsys.readouterr().out
    assert "  checkpoint: 96.4 GB" in out and "host memory, 6.0 GB; ~12 s to write (8 ranks per node, 48.2 GB" in out


def test_plan_json_has_the_choice_checkpoint(capsys):
    assert main(BASE + ["--json", "--top", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    choice = data["layouts"][0]
    ranks = choice["tp"] * choice["pp"] * choice["cp"] * choice["dp"]
    assert data["checkpoint"] == {"trainable_params": 8_030_261_248, "total_gb": pytest.approx(96.363, abs=1e-3),
                                  "rank_host_memory_gb": pytest.approx(96.363 / ranks, abs=1e-3),
                                  "ranks_per_node": 8, "write_s": pytest.approx(96.363 / ranks * 8 / 2, abs=0.01),
                                  "assumed_write_gbps_per_node": 2.0}
