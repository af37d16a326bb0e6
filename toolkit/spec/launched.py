"""The cluster a script was launched on, where it differs from the spec's: torchrun, the `deepspeed` launcher
and mpirun say how many processes they started; a spec written for another count would fail after its checks
(`world size 4 != tp x cp x dp x pp = 2`) on every rank. As megatron and DeepSpeed do, the launch decides the world
size and the data-parallel size follows from it (the global batch stays the spec's: the accumulation adapts); the
checks then run on that cluster. Pure: the caller passes the environment."""

from __future__ import annotations

from collections.abc import Mapping

from toolkit.spec.schema import JobSpec

# torchrun and the deepspeed launcher set WORLD_SIZE (so does job.sbatch's torchrun per node), mpirun its own.
# Not SLURM_NTASKS: an allocation sets it for a plain `python train.py` too, which is no launch of that many.
WORLD_KEYS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
LOCAL_KEYS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")  # processes on this node


def launched_world(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(world size, processes per node) from the launcher's variables; None outside a launcher."""
    world = next((environ[key] for key in WORLD_KEYS if environ.get(key)), None)
    if world is None or not world.isdigit():
        return None
    local = next((environ[key] for key in LOCAL_KEYS if environ.get(key)), None)
    world_size = int(world)
    per_node = int(local) if local and local.isdigit() and world_size % int(local) == 0 else world_size
    return world_size, per_node


def fit_to_launch(spec: JobSpec, *, environ: Mapping[str, str]) -> tuple[JobSpec, str | None]:
    """The spec with cluster.nodes / gpus_per_node of the launch, and the line rank 0 prints about it (None when
    the spec already matches, or outside a launcher)."""
    launched = launched_world(environ)
    cluster = spec.cluster
    if launched is None or launched[0] == cluster.nodes * cluster.gpus_per_node:
        return spec, None
    world_size, per_node = launched
    nodes = world_size // per_node
    adjusted = spec.model_copy(update={"cluster": cluster.model_copy(update={"nodes": nodes,
                                                                             "gpus_per_node": per_node})})
    line = (f"dsmt: the launcher started {world_size} processes ({nodes} node(s) x {per_node}); the spec's cluster "
            f"says {cluster.nodes} x {cluster.gpus_per_node} = {cluster.nodes * cluster.gpus_per_node}: running "
            f"with the launch's (data parallelism follows; set cluster.nodes / cluster.gpus_per_node to match it "
            "and this line goes)")
    return adjusted, line
