"""The time model's rules: data-parallel overlap as dsmt's engine runs DeepSpeed, context parallelism (compute
split, ring exchange, dp x cp reduction), rail-optimised group bandwidth, memory-bound kernels."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.collectives import group_bandwidth_gbps
from toolkit.plan.timing import elementwise_bytes, estimate_step_time
from toolkit.plan.zero_traffic import overlap_share
from toolkit.models.shapes import BUILTIN_SHAPES

H100 = get_gpu("h100-80gb")
LLAMA8 = BUILTIN_SHAPES["llama3-8b"]


def _step(layout, *, nodes=2, seq=8192, batch=64, shape=LLAMA8, **assume):
    cluster = Cluster(nodes=nodes, gpus_per_node=8, gpu=H100)
    return estimate_step_time(shape=shape, layout=layout, training=TrainingShape(seq, batch), cluster=cluster,
                              assumptions=Assumptions(**assume))


@pytest.mark.parametrize("pp, zero, hides", [(2, 1, False), (1, 0, False), (1, 1, False), (1, 2, True), (1, 3, True)])
def test_dp_overlap_follows_the_engine(pp, zero, hides):
    """engine_config sets overlap_comm false at pp > 1 and reduces after the schedule; ZeRO-0 and bf16 ZeRO-1
    (BF16_Optimizer) reduce at the accumulation boundary; only ZeRO-2/3 hooks at pp = 1 run beside backward."""
    layout = PlanLayout(tp=1, pp=pp, dp=16 // pp, zero_stage=zero)
    share = overlap_share(layout=layout, assumptions=Assumptions(dp_overlap=1.0))
    assert share == (1.0 if hides else 0.0)
    t = _step(layout, dp_overlap=1.0)
    assert (t.dp_hidden_s > 0) == hides
    if not hides:
        assert t.dp_comm_s > 0


def test_group_bandwidth_is_nvlink_inside_a_node_and_rails_across():
    cluster = Cluster(nodes=4, gpus_per_node=8, gpu=H100)
    assert group_bandwidth_gbps(stride=1, size=8, cluster=cluster) == H100.nvlink_gbps
    assert group_bandwidth_gbps(stride=2, size=4, cluster=cluster) == H100.nvlink_gbps
    # across nodes: the group's ranks in one node send over as many NICs, at most NVLink
    assert group_bandwidth_gbps(stride=8, size=4, cluster=cluster) == H100.ib_gbps
    assert group_bandwidth_gbps(stride=4, size=8, cluster=cluster) == 2 * H100.ib_gbps
    assert group_bandwidth_gbps(stride=1, size=32, cluster=cluster) == min(H100.nvlink_gbps, 8 * H100.ib_gbps)


def test_context_parallel_splits_compute_and_reduces_over_dp_times_cp():
    """cp = 2 halves each rank's tokens (twice the micro-batches per rank at the same global batch): the same
    compute over the step; the gradient reduction runs over dp x cp ranks, as wide as dp alone at cp = 1."""
    flat = _step(PlanLayout(tp=1, pp=1, dp=16, zero_stage=1))
    ring = _step(PlanLayout(tp=1, pp=1, dp=8, cp=2, zero_stage=1))
    assert ring.compute_s == pytest.approx(flat.compute_s, rel=1e-9)
    assert ring.elementwise_s == pytest.approx(flat.elementwise_s, rel=1e-9)
    assert ring.dp_comm_s == pytest.approx(flat.dp_comm_s, rel=1e-9)
    assert flat.cp_comm_s == 0 and ring.cp_comm_s > 0


def test_context_parallel_ring_exchange_volume():
    """Per layer and micro-batch the ring passes a K and V chunk (2 x b x s/cp x kv_heads x head_dim / tp, bf16)
    cp-1 times forward and twice that backward; with cp_overlap = 0 all of it is exposed."""
    a = Assumptions(cp_overlap=0.0)
    tp, cp, seq = 2, 4, 32768
    layout = PlanLayout(tp=tp, pp=1, dp=2, cp=cp, sp=True, zero_stage=1)
    t = _step(layout, seq=seq, batch=8, cp_overlap=0.0)
    num_micro = 8 // 2
    chunk = 2 * (seq // cp) * LLAMA8.num_kv_heads * LLAMA8.kv_channels / tp * 2
    link = group_bandwidth_gbps(stride=tp, size=cp, cluster=Cluster(nodes=2, gpus_per_node=8, gpu=H100))
    exchange = chunk / (link * 1e9 * a.link_efficiency) + a.collective_latency_s
    assert t.cp_comm_s == pytest.approx(3 * (cp - 1) * exchange * LLAMA8.num_layers * num_micro)
    hidden = _step(layout, seq=seq, batch=8, cp_overlap=1.0)
    assert 0 <= hidden.cp_comm_s < t.cp_comm_s


def test_memory_bound_bytes_follow_the_counted_tensors():
    """Forward per token: 10h (norms, residual adds; split by SP) + 3f (SwiGLU; split by TP), bf16; backward 2x."""
    h, f, tokens = LLAMA8.hidden_size, LLAMA8.ffn_hidden_size, 4096
    layout = PlanLayout(tp=2, pp=1, dp=1, sp=True)
    got = elementwise_bytes(shape=LLAMA8, layout=layout, tokens=tokens, seq_length=tokens, assumptions=Assumptions())
    assert got == pytest.approx((10 * h / 2 + 3 * f / 2) * tokens * 2 * 3)
    local = elementwise_bytes(shape=LLAMA8, layout=layout, tokens=tokens, seq_length=tokens,
                              assumptions=Assumptions(attention="local"))
    assert local - got == pytest.approx(2 * LLAMA8.num_attention_heads * tokens / 2 * tokens * 2 * 3)
    full = elementwise_bytes(shape=LLAMA8, layout=dataclasses.replace(layout, recompute="full"), tokens=tokens,
                             seq_length=tokens, assumptions=Assumptions())
    assert full == pytest.approx(got * 4 / 3)  # the recomputed forward


def test_uneven_published_split_times_the_fullest_stage():
    """Llama 3 405B ran 126 layers in 16 stages (8 on the fullest): timed, though megatron-core's even split
    cannot express it (the planner never proposes it)."""
    shape = BUILTIN_SHAPES["llama3-405b"]
    sixteen = _step(PlanLayout(tp=8, pp=16, dp=1), nodes=16, batch=16, shape=shape)
    eighteen = _step(PlanLayout(tp=8, pp=18, dp=1), nodes=18, batch=16, shape=shape)
    assert sixteen.compute_s > eighteen.compute_s  # 8 layers against 7
