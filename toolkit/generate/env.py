""".deepspeed_env: environment exported on every node (DeepSpeed forwards it; the scripts source it too).

This module computes the exports; the template launch/deepspeed_env (or a site's copy) writes them. DeepSpeed
splits each line on the first '=' and pdsh exports the value unquoted, so the file holds only `NAME=value` lines
with no comments or blank lines, and values are restricted to shell-inert characters (validated in the schema).
"""

from __future__ import annotations

from toolkit.generate.templates import LaunchTemplates
from toolkit.spec.schema import JobSpec


def environment(*, spec: JobSpec) -> dict[str, str]:
    """The exports for the spec's cluster: the presets, then extra_env (which wins; summary.txt names each preset
    it replaces)."""
    return {**preset_environment(spec=spec), **spec.communication.extra_env}


def preset_environment(*, spec: JobSpec) -> dict[str, str]:
    """NCCL presets by interconnect (or gloo settings on CPU), before communication.extra_env."""
    env = _cpu_env(spec=spec) if spec.cluster.device == "cpu" else _nccl_env(spec=spec)
    if spec.parallel.tp > 1 and spec.cluster.device == "cuda":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # megatron TP/SP comm overlap needs ordered kernel launches
    return env


def _nccl_env(*, spec: JobSpec) -> dict[str, str]:
    comm, iface = spec.communication, spec.cluster.network_interface
    env = {"NCCL_DEBUG": comm.nccl_debug, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if spec.cluster.interconnect == "tcp":
        env["NCCL_IB_DISABLE"] = "1"  # no RDMA: keep NCCL from probing absent HCAs
        env["NCCL_NET"] = "Socket"
    else:
        env["NCCL_IB_DISABLE"] = "0"
        if comm.nccl_ib_hca:
            env["NCCL_IB_HCA"] = comm.nccl_ib_hca
        if spec.cluster.interconnect == "roce":
            env["NCCL_IB_GID_INDEX"] = str(comm.nccl_ib_gid_index)  # RoCE v2 GID; 3 on most NICs
    if iface:
        env["NCCL_SOCKET_IFNAME"] = iface  # bootstrap / socket traffic on this interface, not docker0 or lo
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


def _cpu_env(*, spec: JobSpec) -> dict[str, str]:
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # one thread per rank; ranks share the cores
    if spec.cluster.network_interface:
        env["GLOO_SOCKET_IFNAME"] = spec.cluster.network_interface
    return env


def render_deepspeed_env(*, spec: JobSpec, templates: LaunchTemplates) -> str:
    return templates.render(name="deepspeed_env", context={"environment": environment(spec=spec)})
