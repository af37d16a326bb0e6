"""Time of one NCCL collective over a group of ranks: bandwidth from the links the group crosses, latency from
NCCL's own cost model.

Sources
  * Bandwidth: ring bounds from nccl-tests PERFORMANCE.md, all-reduce 2(n-1)/n·S/B, reduce-scatter and
    all-gather (n-1)/n·S/B, B the bus bandwidth per GPU. Inside one node that is NVLink. Across nodes each GPU
    has its own NIC (rail-optimised DGX / HGX nodes, hardware.py) and NCCL stripes its rings over the NICs of the
    group's ranks in a node, so a group with k ranks per node gets k NICs' bandwidth, at most NVLink. Measured:
    8 A100s with 4 HDR NICs per node reach 85-96 GB/s all-reduce bus bandwidth across nodes, of 4 x 25 GB/s
    (NVIDIA/nccl-tests issues 119, 175; NVIDIA/nccl issue 1048).
  * Latency: NCCL's tuning model as an older release wrote it (src/graph/tuning.cc at NVIDIA/nccl 01afd20, when
    it had three algorithms: tree, ring, collnet; ncclTopoTuneModel, ring algorithm, Simple protocol): a
    base latency per call plus one hop latency per ring step, nsteps = n-1 (all-gather, reduce-scatter) or
    2(n-1) (all-reduce), of which nodes-1 (twice for all-reduce) cross the network: 8.4 us + 3.4 us per NVLink
    step + 9.6 us per network step. A collective over 1,536 GPUs in 192 nodes pays 6.4 ms per call whatever its
    size, which is what makes per-module ZeRO-3 gathers expensive at scale. The model keeps the ring for every
    collective; newer NCCL releases raise the network step to 14 us and run multi-node all-reduces as trees
    (log-depth latency) or NVLS, so all-reduce latency at scale is an upper bound here.
"""

from __future__ import annotations

import math

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import Cluster


def group_span(*, stride: int, size: int, cluster: Cluster) -> tuple[int, int]:
    """(ranks of the group per node, nodes the group spans) for `size` ranks placed `stride` ranks apart."""
    per_node = cluster.gpus_per_node
    ranks_per_node = max(1, min(size, per_node // stride))
    return ranks_per_node, math.ceil(size / ranks_per_node)


def group_bandwidth_gbps(*, stride: int, size: int, cluster: Cluster) -> float:
    """Per-GPU bus bandwidth of a ring over `size` ranks placed `stride` ranks apart: NVLink inside one node;
    across nodes the k ranks of the group that share a node send over their k NICs at once, at most NVLink."""
    ranks_per_node, nodes = group_span(stride=stride, size=size, cluster=cluster)
    if nodes <= 1:
        return cluster.gpu.nvlink_gbps
    return min(cluster.gpu.nvlink_gbps, ranks_per_node * cluster.gpu.ib_gbps)


def ring_latency_s(*, kind: str, group_size: int, nodes: int, assumptions: Assumptions) -> float:
    """NCCL's latency of one ring collective call (module docstring)."""
    if group_size <= 1:
        return 0.0
    twice = 2 if kind == "all_reduce" else 1
    steps, network_steps = twice * (group_size - 1), twice * (max(nodes, 1) - 1)
    return (assumptions.collective_latency_s + (steps - network_steps) * assumptions.nvlink_hop_latency_s
            + network_steps * assumptions.net_hop_latency_s)


def ring_time_s(*, kind: str, message_bytes: float, group_size: int, bandwidth_gbps: float,
                assumptions: Assumptions, nodes: int = 1, calls: int = 1, latency_scale: float = 1.0) -> float:
    """`message_bytes` moved by `calls` ring collectives of one kind (all_reduce, reduce_scatter, all_gather)
    over `group_size` ranks in `nodes` nodes: the ring bound plus NCCL's latency per call."""
    if group_size <= 1 or message_bytes <= 0:
        return 0.0
    factor = (2.0 if kind == "all_reduce" else 1.0) * (group_size - 1) / group_size
    bandwidth = bandwidth_gbps * 1e9 * assumptions.link_efficiency
    latency = ring_latency_s(kind=kind, group_size=group_size, nodes=nodes, assumptions=assumptions)
    return factor * message_bytes / bandwidth + max(1, calls) * latency * latency_scale


def group_ring_time_s(*, kind: str, message_bytes: float, stride: int, size: int, cluster: Cluster,
                      assumptions: Assumptions, calls: int = 1, latency_scale: float = 1.0) -> float:
    """ring_time_s over the group of `size` ranks `stride` apart, with its links and node span."""
    _, nodes = group_span(stride=stride, size=size, cluster=cluster)
    return ring_time_s(kind=kind, message_bytes=message_bytes, group_size=size, nodes=nodes, calls=calls,
                       latency_scale=latency_scale,
                       bandwidth_gbps=group_bandwidth_gbps(stride=stride, size=size, cluster=cluster),
                       assumptions=assumptions)
