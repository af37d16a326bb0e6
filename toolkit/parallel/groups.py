"""Process-group set-up for a layout (the layout itself: toolkit/parallel/layout.py; its rules: toolkit/parallel/rules.py)."""

from __future__ import annotations

import datetime

from toolkit.errors import DsmtError
from toolkit.parallel.layout import Layout, divisors  # noqa: F401  (callers import them from here)


class LayoutError(DsmtError):
    """A layout that does not fit the model or the world (the rules: toolkit/parallel/rules.py)."""


def init_process_groups(*, layout: Layout, dist_backend: str, timeout_s: float = 600.0) -> None:
    """This rank's own device (cuda:<LOCAL_RANK>), then torch.distributed (from the launcher's environment: RANK,
    WORLD_SIZE, MASTER_ADDR/PORT) bound to it, then megatron's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends

    adopt_mpi_ranks()
    device = backends.use_rank_device()  # before the group: NCCL and megatron's buffers use the current device
    if not dist.is_initialized():
        # device_id binds the NCCL communicators to this rank's GPU (gloo takes no device).
        bound = {"device_id": device} if dist_backend == "nccl" else {}
        dist.init_process_group(backend=dist_backend, timeout=datetime.timedelta(seconds=timeout_s), **bound)
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"world size {world} != tp x cp x dp x pp = {layout.tp} x {layout.cp} x {layout.dp} x {layout.pp} = "
            f"{layout.world_size}; launch {layout.world_size} processes or change the layout"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        # megatron's gloo copies of the DP groups serve its distributed optimizer's CPU paths, which dsmt never
        # takes (DeepSpeed reduces); created by default, they are one more rendezvous per group over the
        # hostname's interface, a classic multi-node hang where it resolves to the wrong one.
        create_gloo_process_groups=False,
        # megatron's own groups wait 30 min by default whatever the world's timeout: the same for every group
        distributed_timeout_minutes=timeout_s / 60,
    )


# Open MPI's names for what torchrun and the deepspeed launcher export (mpirun starts the ranks itself).
_OMPI_RANK_ENV = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
                  "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK"}


def adopt_mpi_ranks(*, environ=None) -> None:
    """Under mpirun (launch_deepspeed.sh with cluster.launcher: openmpi) set RANK / WORLD_SIZE / LOCAL_RANK from
    OMPI_COMM_WORLD_*, as DeepSpeed's MPI discovery does without mpi4py; the script forwards MASTER_ADDR/PORT.
    A launcher that set RANK itself wins."""
    import os

    environ = os.environ if environ is None else environ
    if "RANK" in environ or "OMPI_COMM_WORLD_RANK" not in environ:
        return
    for name, ompi_name in _OMPI_RANK_ENV.items():
        environ[name] = environ[ompi_name]


def destroy_process_groups() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        destroy_world()


def destroy_world() -> None:
    """Destroy the default process group, through DeepSpeed when it has used it: DeepSpeed caches the world group
    (and its data-parallel groups) in module globals, and only its own destroy forgets them. A stale cache breaks
    the next `deepspeed.initialize` in this process ("Group ... is not registered")."""
    import sys

    import torch.distributed as dist

    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
