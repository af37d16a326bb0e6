"""Where dsmt runs: CUDA (NCCL, Transformer Engine when installed) by default, the CPU (gloo) when CUDA is absent.

This is the one place that knows the difference. Everything else asks `current()` for the device, the
torch.distributed backend, the megatron layer spec flavour and how to seed megatron's RNG tracker.

Per rank, in this order: `select(device=spec.cluster.device)` (the spec's device must be this machine's: never a
silent CPU run on a GPU node), then `use_rank_device()` (cuda:<LOCAL_RANK> made current, before the process group
exists, so NCCL, `Backend.device` and megatron's `torch.cuda.current_device()` buffers all name the rank's own GPU),
then the process group (`toolkit.parallel.groups.init_process_groups` does the last two).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Mapping

import torch

from toolkit.errors import DsmtError


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # "cuda" or "cpu"
    dist_backend: str  # "nccl" or "gloo"
    use_transformer_engine: bool
    # Batched p2p (torch's batch_isend_irecv) lets NCCL pair concurrent sends and receives. Gloo pairs them by
    # posting order per peer, so with PP=2 (next rank == previous rank) the interleaved schedule's simultaneous
    # activation and gradient transfers can cross; megatron's unbatched path orders them by rank parity instead.
    batch_p2p_comm: bool = True

    @property
    def device(self) -> torch.device:
        """This rank's device: cuda:<LOCAL_RANK> once `use_rank_device()` ran, the current CUDA device before."""
        if self.name == "cuda":
            return _rank_device or torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def to_device(self, batches: list[dict]) -> list[dict]:
        """Micro-batches (dicts of host tensors) on this rank's device, as new dicts: on CUDA pinned and copied
        non-blocking on a side stream the compute stream waits for (toolkit/backend/copies.py), so the host never
        waits for the GPU here; on the CPU they already are where the model is."""
        from toolkit.backend import copies

        if self.name == "cuda":
            return copies.copy_to_cuda(batches, device=self.device)
        return copies.copy_on_host(batches)

    def seed(self, seed: int) -> None:
        """Seed torch and megatron's model-parallel RNG tracker (call after parallel state is initialized)."""
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)  # megatron seeds only the CUDA generator; CPU initialisation uses this one
        # On the CPU the CUDA RNG tracker cannot save/restore generator states; its inference flavour makes
        # `fork()` a no-op, which only matters for dropout inside tensor-parallel regions (dsmt uses dropout 0).
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=self.name == "cpu")


@functools.cache
def current() -> Backend:
    """The backend of this process. On a machine without CUDA this installs the CPU redirections (once)."""
    if torch.cuda.is_available():
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return Backend(name="cuda", dist_backend="nccl", use_transformer_engine=has_te)
    from toolkit.backend import cpu

    cpu.install()
    return Backend(name="cpu", dist_backend="gloo", use_transformer_engine=False, batch_p2p_comm=False)


class DeviceError(DsmtError):
    """The spec's device is not this machine's, or this rank has no GPU of its own."""


_rank_device: torch.device | None = None  # set once by use_rank_device()


def select(*, device: str) -> Backend:
    """The backend for a job spec's `cluster.device` ("cuda" or "cpu"), refused when this machine differs.

    Backend choice stays automatic (`current()`); this only makes a spec/machine mismatch an error instead of
    a silent CPU run on a GPU node whose CUDA broke, or CUDA code on a machine the spec calls a CPU."""
    if device not in ("cuda", "cpu"):
        raise DeviceError(f"cluster.device={device!r}; valid: cuda, cpu")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise DeviceError(
            "cluster.device=cuda but CUDA is not available on this machine (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); for a CPU run set "
            "cluster.device: cpu and cluster.gpu: cpu; on a GPU node check the driver (nvidia-smi), "
            "CUDA_VISIBLE_DEVICES and that torch is a CUDA build"
        )
    if device == "cpu" and has_cuda:
        # The CPU backend redirects megatron's hard-coded CUDA calls only where CUDA is absent (toolkit/backend/cpu.py);
        # with GPUs visible those calls would land on cuda:0 next to CPU weights.
        raise DeviceError(
            f"cluster.device=cpu but this machine has CUDA ({torch.cuda.device_count()} GPU(s) visible); to train "
            "on the CPU hide the GPUs (CUDA_VISIBLE_DEVICES= with an empty value), or set cluster.device: cuda and "
            "cluster.gpu to this GPU's preset to use them"
        )
    return current()


def local_rank_from(environ: Mapping[str, str]) -> int:
    """This process's index on its node: LOCAL_RANK (torchrun, the deepspeed launcher), else SLURM_LOCALID (srun
    with one task per GPU), else 0 for a lone process."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = environ.get(name)
        if value is not None:
            if not value.isdigit():
                raise DeviceError(f"{name}={value!r} is not a process index (0, 1, ...); check the launcher")
            return int(value)
    world_size = environ.get("WORLD_SIZE", "1")
    if world_size.isdigit() and int(world_size) > 1:
        raise DeviceError(f"WORLD_SIZE={world_size} but neither LOCAL_RANK nor SLURM_LOCALID is set, so this rank "
                          "cannot tell which GPU is its own; launch with torchrun, the deepspeed launcher or srun")
    return 0


def use_rank_device(environ: Mapping[str, str] | None = None) -> torch.device:
    """Make this rank's own GPU (cuda:<local rank>) current and return it; on the CPU backend, cpu (no CUDA call).

    Call before `torch.distributed.init_process_group`: NCCL binds each communicator to the current device, and
    megatron allocates buffers on `torch.cuda.current_device()`; without it every rank of a node uses cuda:0."""
    global _rank_device
    if current().name != "cuda":
        return torch.device("cpu")
    local_rank = local_rank_from(os.environ if environ is None else environ)
    num_gpus = torch.cuda.device_count()
    if local_rank >= num_gpus:
        raise DeviceError(
            f"local rank {local_rank} needs GPU {local_rank}, but this node has {num_gpus} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); launch at most "
            f"{num_gpus} processes per node (cluster.gpus_per_node <= {num_gpus}) or make more GPUs visible"
        )
    torch.cuda.set_device(local_rank)
    _rank_device = torch.device("cuda", local_rank)
    return _rank_device
