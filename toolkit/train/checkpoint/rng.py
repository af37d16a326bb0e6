"""The per-rank RNG file holds every generator a step can draw from: torch's CPU generator, the CUDA generator of
this rank's device (when CUDA is available), megatron's RNG tracker states (the tensor-parallel / expert streams
dropout forks into; on the CPU backend dsmt seeds megatron's inference-flavour tracker, which holds no states and
makes `fork()` a no-op, so there is nothing to save and that is recorded as such), and Python's `random` and
numpy's global generator (dsmt draws from neither; libraries might). Saved per rank in each checkpoint
(toolkit/train/checkpoint/checkpoints.py) and restored when a run resumes at the layout that wrote it."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_states() -> dict:
    """Every RNG state of this process a training step may draw from (see the module docstring)."""
    from megatron.core.tensor_parallel import random as megatron_random

    numpy_state = np.random.get_state(legacy=False)
    states = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "megatron_tracker": None,
        "python": random.getstate(),
        # As tensors and ints: torch.load(weights_only=True) refuses numpy arrays.
        "numpy": {"state": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
    }
    if megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:  # not touched (or created) when nothing seeded it
        tracker = megatron_random.get_cuda_rng_tracker()
        states["megatron_tracker"] = {name: state.clone() for name, state in tracker.get_states().items()}
    return states


def restore_rng_states(states: dict) -> None:
    """Set every generator `rng_states` saved; the tracker only when states were saved (the CPU backend's
    inference-flavour tracker has none, and `set_states({})` would wipe a real tracker's streams)."""
    from megatron.core.tensor_parallel import random as megatron_random

    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if states.get("megatron_tracker"):
        megatron_random.get_cuda_rng_tracker().set_states(dict(states["megatron_tracker"]))
    if states.get("python") is not None:
        random.setstate(states["python"])
    if states.get("numpy") is not None:
        saved = states["numpy"]
        np.random.set_state(("MT19937", saved["state"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                             saved["gauss"]))
