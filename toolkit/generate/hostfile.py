"""The hostfile in DeepSpeed's `host slots=N` form, and the resolved host list / master address."""

from __future__ import annotations

from toolkit.spec.schema import JobSpec

LOOPBACK_ADDR = "127.0.0.1"


def host_names(spec: JobSpec) -> list[str] | None:
    """The node names in rank order; None when SLURM supplies them at run time."""
    if spec.cluster.hosts == "slurm":
        return None
    return list(spec.cluster.hosts) if spec.cluster.hosts is not None else ["localhost"]


def is_local(spec: JobSpec) -> bool:
    """One node and no SLURM: everything runs on this machine, no ssh."""
    return spec.cluster.nodes == 1 and spec.cluster.hosts != "slurm"


def master_address(spec: JobSpec) -> str | None:
    """The rendezvous address; None when it is the first SLURM node (known only at run time)."""
    if spec.cluster.master_addr is not None:
        return spec.cluster.master_addr
    hosts = host_names(spec)
    if hosts is None:
        return None
    return LOOPBACK_ADDR if is_local(spec) else hosts[0]


def render_hostfile(*, spec: JobSpec) -> str:
    hosts = host_names(spec)
    slots = spec.cluster.gpus_per_node
    if hosts is None:
        return (f"# hosts come from SLURM: launch_deepspeed.sh writes hostfile.slurm.$SLURM_JOB_ID "
                f"({slots} slots per node) at run time\n")
    return "".join(f"{host} slots={slots}\n" for host in hosts)
