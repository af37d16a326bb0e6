"""ZeRO traffic as DeepSpeed 0.19 sends it (toolkit/plan/zero_traffic.py), each rule against figures computed by
hand here: 16 H100s in two nodes (one 50 GB/s NIC per GPU, NVLink 450 GB/s), link efficiency 0.8, NCCL's ring
latency 8.4 us + 3.4 us per NVLink step + 9.6 us per network step."""

from __future__ import annotations

import math

import pytest

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.collectives import group_span, ring_latency_s
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import Cluster, PlanLayout
from toolkit.plan.zero_traffic import dp_traffic, regathered_share

H100 = get_gpu("h100-80gb")
TWO_NODES = Cluster(nodes=2, gpus_per_node=8, gpu=H100)
P = 1_000_000_000            # parameters one rank's stage holds
MODULES = 129                # 4 per layer of a 32-layer model, and the embedding
FORWARD_S, BACKWARD_S = 2.0, 4.0
# 16 ranks, 8 per node: the ring crosses the network at 8 NICs' bandwidth, capped by NVLink: 400 GB/s x 0.8.
BW = 400e9 * 0.8
AG_LAT = (8.4 + (15 - 1) * 3.4 + 1 * 9.6) * 1e-6         # 15 steps, 1 of them between the two nodes
AR_LAT = (8.4 + (30 - 2) * 3.4 + 2 * 9.6) * 1e-6         # all-reduce: twice the steps


def _traffic(*, zero, m=2, pp=1, dp=16, tp=1, groups=None, trainable=1.0, **assume):
    """Hand figures use NCCL's own latency and half the traffic hidden; the fitted values are tested apart."""
    assume = {"deepspeed_latency_scale": 1.0, "dp_overlap": 0.5, **assume}
    layout = PlanLayout(tp=tp, pp=pp, dp=dp, zero_stage=zero)
    return dp_traffic(layout=layout, cluster=TWO_NODES, num_micro=m, groups=groups or [(P, dp, tp)],
                      modules=MODULES, forward_compute_s=FORWARD_S, backward_compute_s=BACKWARD_S,
                      assumptions=Assumptions(**assume), trainable=trainable)


def test_nccl_latency_counts_ring_steps_and_network_hops():
    a = Assumptions()
    assert ring_latency_s(kind="all_gather", group_size=16, nodes=2, assumptions=a) == pytest.approx(AG_LAT)
    assert ring_latency_s(kind="all_reduce", group_size=16, nodes=2, assumptions=a) == pytest.approx(AR_LAT)
    # 1,536 ranks in 192 nodes: 1,535 steps, 191 of them between nodes
    big = ring_latency_s(kind="reduce_scatter", group_size=1536, nodes=192, assumptions=a)
    assert big == pytest.approx((8.4 + 1344 * 3.4 + 191 * 9.6) * 1e-6)
    assert group_span(stride=8, size=4, cluster=Cluster(nodes=4, gpus_per_node=8, gpu=H100)) == (1, 4)


def test_zero3_gathers_twice_and_reduce_scatters_every_micro_batch():
    """Forward: all-gather of 2-byte weights, one call per module (the 5e7-element prefetch bucket coalesces
    1e9 / 5e7 = 20 calls' worth, fewer than the 129 modules); backward: the same again plus a reduce-scatter
    of 4-byte gradients in 1e9 / 5e8 = 2 buckets."""
    gather = 15 / 16 * 2 * P / BW + 20 * AG_LAT
    scatter = 15 / 16 * 4 * P / BW + 2 * AG_LAT
    for m in (1, 3):
        t = _traffic(zero=3, m=m)
        assert t.forward_s == pytest.approx(m * gather)
        assert t.backward_s == pytest.approx(m * (gather + scatter))
        assert t.after_step_s == 0
        # overlap_comm at pp = 1: half of the smaller of traffic and compute, per phase
        assert t.hidden_s == pytest.approx(0.5 * (min(m * gather, FORWARD_S) + min(m * (gather + scatter),
                                                                                     BACKWARD_S)))


def test_zero3_keeps_the_last_layers_gathered_for_their_backward():
    """stage3_max_reuse_distance (1e9 elements): 32 layers of 2e8 (P = 6.4e9) keep the last ceil(1e9 / 4e8) = 3
    gathered through backward; 29 / 32 are gathered again. 1e9 parameters in 32 layers keep the last 16; 4e8
    keep all 32."""
    big = 6_400_000_000
    assert regathered_share(params=big, layers=32, assumptions=Assumptions()) == pytest.approx(29 / 32)
    assert regathered_share(params=P, layers=32, assumptions=Assumptions()) == 0.5
    assert regathered_share(params=400_000_000, layers=32, assumptions=Assumptions()) == 0.0
    layout = PlanLayout(tp=1, pp=1, dp=16, zero_stage=3)
    t = dp_traffic(layout=layout, cluster=TWO_NODES, num_micro=1, groups=[(big, 16, 1)], modules=MODULES,
                   forward_compute_s=FORWARD_S, backward_compute_s=BACKWARD_S, layers=32,
                   assumptions=Assumptions(deepspeed_latency_scale=1.0))
    calls = min(MODULES, math.ceil(big / 50_000_000))                       # 129: one per module
    gather = 15 / 16 * 2 * big / BW
    scatter = 15 / 16 * 4 * big / BW + math.ceil(big / 500_000_000) * AG_LAT
    assert t.forward_s == pytest.approx(gather + calls * AG_LAT)
    assert t.backward_s == pytest.approx(29 / 32 * gather + round(calls * 29 / 32) * AG_LAT + scatter)


def test_zero2_all_reduces_every_micro_batch_and_gathers_after_the_step():
    """DeepSpeed 0.19's stage 1/2 optimizer all-reduces each gradient bucket (use_multi_rank_bucket_allreduce),
    every micro-batch at ZeRO-2; the updated 16-bit weights are all-gathered once after the step."""
    reduce = 2 * 15 / 16 * 4 * P / BW + 2 * AR_LAT
    t = _traffic(zero=2, m=4)
    assert t.backward_s == pytest.approx(4 * reduce)
    assert t.after_step_s == pytest.approx(15 / 16 * 2 * P / BW + 2 * AG_LAT)
    assert t.forward_s == 0


@pytest.mark.parametrize("zero", [0, 1])
def test_zero01_reduce_once_per_step_whatever_the_accumulation(zero):
    one, four = _traffic(zero=zero, m=1), _traffic(zero=zero, m=4)
    assert one.total_s == pytest.approx(four.total_s)
    expected = 2 * 15 / 16 * 4 * P / BW + 2 * AR_LAT + (15 / 16 * 2 * P / BW + 2 * AG_LAT if zero else 0.0)
    assert one.after_step_s == pytest.approx(expected) and one.hidden_s == 0


def test_gradient_bytes_follow_communication_data_type():
    fp32, bf16 = _traffic(zero=2, m=1), _traffic(zero=2, m=1, dp_grad_comm_bytes=2)
    assert fp32.backward_s - bf16.backward_s == pytest.approx(2 * 15 / 16 * 2 * P / BW)


def test_one_latency_per_bucket():
    """Halving reduce_bucket_size doubles the reduce calls: 2 more all-reduce latencies per micro-batch."""
    base, small = _traffic(zero=2, m=3), _traffic(zero=2, m=3, reduce_bucket_elements=250_000_000)
    assert small.backward_s - base.backward_s == pytest.approx(3 * 2 * AR_LAT)


def test_the_link_a_group_crosses():
    """tp = 8 puts each DP group's ranks a node apart: one rank per node, one NIC (50 GB/s), every ring step
    on the network; a group inside one node runs over NVLink."""
    across = _traffic(zero=1, m=1, dp=2, tp=8)
    lat = (8.4 + 2 * 9.6) * 1e-6, (8.4 + 9.6) * 1e-6      # all-reduce, all-gather over 2 ranks in 2 nodes
    assert across.after_step_s == pytest.approx(2 * 1 / 2 * 4 * P / (50e9 * 0.8) + 2 * lat[0]
                                                + 1 / 2 * 2 * P / (50e9 * 0.8) + 2 * lat[1])
    inside = _traffic(zero=1, m=1, dp=8, tp=1)
    lat = (8.4 + 14 * 3.4) * 1e-6, (8.4 + 7 * 3.4) * 1e-6
    assert inside.after_step_s == pytest.approx(2 * 7 / 8 * 4 * P / (450e9 * 0.8) + 2 * lat[0]
                                                + 7 / 8 * 2 * P / (450e9 * 0.8) + 2 * lat[1])


@pytest.mark.parametrize("zero, overlap_comm", [(2, False), (1, True), (0, True)])
def test_nothing_hides_where_deepspeed_does_not_overlap(zero, overlap_comm):
    """Without overlap_comm (dsmt's engine turns it off at pp > 1) DeepSpeed reduces on the compute stream;
    ZeRO-0/1 reduce at the accumulation boundary, after the last backward."""
    t = _traffic(zero=zero, m=2, dp=8, overlap_comm=overlap_comm)
    assert t.total_s > 0 and t.hidden_s == 0


def test_deepspeed_latency_scale_multiplies_the_latency_only():
    """The fitted scale (Assumptions.deepspeed_latency_scale) applies to DeepSpeed's calls, not FSDP's."""
    one, three = _traffic(zero=3, m=1), _traffic(zero=3, m=1, deepspeed_latency_scale=3.0)
    calls_latency = 20 * AG_LAT + (20 * AG_LAT + 2 * AG_LAT)     # forward gathers; backward gathers + scatters
    assert three.total_s - one.total_s == pytest.approx(2 * calls_latency)
    fsdp = _traffic(zero=3, m=1, dp_engine="fsdp", deepspeed_latency_scale=3.0)
    assert fsdp.total_s == pytest.approx(one.total_s)
    # fitted on ZeRO-3 runs only: ZeRO-0/1/2 keep NCCL's latency
    for zero in (0, 1, 2):
        assert _traffic(zero=zero, m=1, deepspeed_latency_scale=3.0).total_s == pytest.approx(
            _traffic(zero=zero, m=1).total_s)


def test_fsdp_shard_grad_op_gathers_forward_and_reduce_scatters():
    """The calibration runs' FSDP SHARD_GRAD_OP: a gather before each forward, a reduce-scatter in backward."""
    t = _traffic(zero=2, m=2, dp_engine="fsdp")
    assert t.forward_s == pytest.approx(2 * (15 / 16 * 2 * P / BW + 20 * AG_LAT))
    assert t.backward_s == pytest.approx(2 * (15 / 16 * 4 * P / BW + 2 * AG_LAT))
    assert t.after_step_s == 0


def test_experts_reduce_over_their_own_group():
    """An MoE model's expert parameters travel over expert_dp ranks, the rest over dp: two groups, summed."""
    both = _traffic(zero=1, m=1, groups=[(P, 16, 1), (P // 2, 2, 8)])
    dense = _traffic(zero=1, m=1)
    experts = _traffic(zero=1, m=1, dp=2, tp=8, groups=[(P // 2, 2, 8)])
    assert both.after_step_s == pytest.approx(dense.after_step_s + experts.after_step_s)
    assert math.isclose(both.hidden_s, 0.0)


def test_lora_reduces_only_the_adapters():
    """1 % of the parameters trainable: ZeRO-1's reduction and weight gather move 1 % of the bytes (one bucket,
    two parameter groups); ZeRO-3 still gathers every weight."""
    t = _traffic(zero=1, m=1, trainable=0.01)
    assert t.after_step_s == pytest.approx(2 * 15 / 16 * 4 * P * 0.01 / BW + AR_LAT
                                           + 15 / 16 * 2 * P * 0.01 / BW + 2 * AG_LAT)
    full, lora = _traffic(zero=3, m=1), _traffic(zero=3, m=1, trainable=0.01)
    assert lora.forward_s == pytest.approx(full.forward_s)
    assert lora.backward_s == pytest.approx(full.backward_s - 15 / 16 * 4 * P * 0.99 / BW - AG_LAT)


def test_zero01_use_the_engines_bucket_not_the_specs():
    """ZeRO-0/1 reduce through the engine's allreduce_gradients (5e8-element buckets) whatever reduce_bucket_size."""
    assert _traffic(zero=1, m=1, reduce_bucket_elements=1000).total_s == pytest.approx(_traffic(zero=1, m=1).total_s)


def test_the_output_layer_counts_against_the_reuse_distance():
    """A 5e8-element output layer, traversed forward and backward, leaves no budget: every layer is gathered again."""
    big = 6_400_000_000
    assert regathered_share(params=big, layers=32, assumptions=Assumptions(), head_params=500_000_000) == 1.0
    assert regathered_share(params=big, layers=32, assumptions=Assumptions(),
                            head_params=100_000_000) == pytest.approx(30 / 32)   # ceil(8e8 / 4e8) = 2 kept
