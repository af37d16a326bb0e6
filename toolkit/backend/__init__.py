"""Where dsmt runs: CUDA (NCCL, Transformer Engine when installed) by default, the CPU (gloo) when CUDA is absent.

This is the one place that knows the difference. Everything else asks `current()` for the device, the
torch.distributed backend, the megatron layer spec flavour and how to seed megatron's RNG tracker.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch


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
        if self.name == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

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
