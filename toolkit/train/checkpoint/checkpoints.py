"""Training checkpoints: DeepSpeed's engine checkpoint (model, optimizer, scheduler) plus dsmt's own record of
what makes a resumed run identical (step, per-rank RNG), and a completion marker written last.

    <output_dir>/checkpoints/step_000010/        DeepSpeed's files for tag step_000010
    <output_dir>/checkpoints/step_000010/dsmt_rng_rank{r}.pt
    <output_dir>/checkpoints/step_000010/layout-free/, dsmt_layout.json   the same state for any other layout
    <output_dir>/checkpoints/step_000010/dsmt_complete.json   written by rank 0 after every rank has saved
    <output_dir>/checkpoints/latest_complete     the newest complete tag (replaced atomically)

A run resumes through DeepSpeed when its layout (TP, PP, VPP, CP, DP, ZeRO stage) is the one in the completion
marker, and from the layout-free copy when it differs (toolkit/train/checkpoint/reshard.py); either way nothing in the
checkpoint is modified.

A run killed while saving leaves a tag without `dsmt_complete.json`; resume never takes it. With
`training.keep_checkpoints: K`, rank 0 deletes the oldest complete tags beyond the newest K after each save.

The per-rank RNG file holds every generator a step can draw from: torch's CPU generator, the CUDA generator of
this rank's device (when CUDA is available), megatron's RNG tracker states (the tensor-parallel / expert streams
dropout forks into; on the CPU backend dsmt seeds megatron's inference-flavour tracker, which holds no states and
makes `fork()` a no-op, so there is nothing to save and that is recorded as such), and Python's `random` and
numpy's global generator (dsmt draws from neither; libraries might)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

COMPLETE_MARKER = "dsmt_complete.json"
LATEST = "latest_complete"


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def save(*, engine, checkpoint_dir: Path, step: int, keep_checkpoints: int | None = None, layout: dict | None = None,
         layout_free=None) -> None:
    """Collective. `layout`: `reshard.layout_record` of this run (kept in the marker); `layout_free`: a
    `reshard.LayoutFreeState` that writes the copy other layouts resume from (None: plain HF models)."""
    import torch.distributed as dist

    tag = tag_for(step)
    rank = dist.get_rank()
    marker = Path(checkpoint_dir) / tag / COMPLETE_MARKER
    again = [marker.exists() if rank == 0 else None]
    dist.broadcast_object_list(again, src=0)  # rank 0 looks for all: every rank takes the same branch
    if again[0]:  # saving a step again (a script may): unmarked first, so a crash mid-way leaves it incomplete, then
        if rank == 0:  # removed (megatron's dist_checkpointing writes into an empty layout-free directory only)
            marker.unlink()
            shutil.rmtree(Path(checkpoint_dir) / tag)
        dist.barrier()
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"dsmt_step": step}, save_latest=False)
    torch.save(rng_states(), Path(checkpoint_dir) / tag / f"dsmt_rng_rank{rank}.pt")
    if layout_free is not None:
        layout_free.save(Path(checkpoint_dir) / tag)
    dist.barrier()
    if rank == 0:
        record = {"step": step, "world_size": dist.get_world_size(), "layout": layout}
        marker.write_text(json.dumps(record))
        temp = Path(checkpoint_dir) / f".{LATEST}.tmp"
        temp.write_text(tag)
        os.replace(temp, Path(checkpoint_dir) / LATEST)
        if keep_checkpoints is not None:
            prune(checkpoint_dir, keep=keep_checkpoints)
    dist.barrier()


def complete_tags(checkpoint_dir: Path) -> list[str]:
    """Tags with a completion marker, oldest first (by step number, not by name)."""
    tags = [p.parent.name for p in Path(checkpoint_dir).glob(f"step_*/{COMPLETE_MARKER}")]
    return sorted((t for t in tags if t[len("step_"):].isdigit()), key=lambda t: int(t[len("step_"):]))


def prune(checkpoint_dir: Path, *, keep: int) -> list[str]:
    """Delete the oldest complete tags beyond the newest `keep`; returns the deleted tags.

    Never deleted: the tag `latest_complete` names, any tag at or after the newest complete one, and incomplete
    tags (one may be another save in progress; a crashed save is left for a person to look at)."""
    from toolkit.errors import DsmtError

    if keep < 1:
        raise DsmtError(f"keep_checkpoints={keep} must be >= 1 (or null to keep every checkpoint)")
    checkpoint_dir = Path(checkpoint_dir)
    tags = complete_tags(checkpoint_dir)
    protected = {latest_complete(checkpoint_dir), *tags[-keep:]}
    doomed = [t for t in tags[:-keep] if t not in protected]
    for tag in doomed:
        (checkpoint_dir / tag / COMPLETE_MARKER).unlink()  # first: a crash mid-delete leaves an incomplete tag
        shutil.rmtree(checkpoint_dir / tag)
    return doomed


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


def latest_complete(checkpoint_dir: Path) -> str | None:
    """The newest tag with a completion marker (the `latest_complete` pointer, else a scan)."""
    checkpoint_dir = Path(checkpoint_dir)
    pointer = checkpoint_dir / LATEST
    if pointer.is_file() and (checkpoint_dir / pointer.read_text().strip() / COMPLETE_MARKER).is_file():
        return pointer.read_text().strip()
    tags = sorted(p.parent.name for p in checkpoint_dir.glob(f"step_*/{COMPLETE_MARKER}"))
    return tags[-1] if tags else None


@dataclasses.dataclass(frozen=True)
class Resumed:
    step: int  # steps already done (0: a fresh start)
    resharded: str | None = None  # "from LAYOUT to LAYOUT" when the state came from the layout-free copy


def resume(*, engine, checkpoint_dir: Path, layout: dict | None = None, layout_free=None) -> Resumed:
    """Load the newest complete checkpoint: through DeepSpeed at the layout that wrote it, else from its
    layout-free copy (`layout_free`, see `save`). Every rank takes the same branch (they read the same marker)."""
    import torch.distributed as dist

    from toolkit.errors import DsmtError
    from toolkit.train.checkpoint.reshard import describe

    tag = latest_complete(checkpoint_dir)
    if tag is None:
        return Resumed(step=0)
    tag_dir = Path(checkpoint_dir) / tag
    marker = json.loads((tag_dir / COMPLETE_MARKER).read_text())
    saved_layout = marker.get("layout")
    same = saved_layout == layout if saved_layout is not None else marker["world_size"] == dist.get_world_size()
    # DeepSpeed's module file keeps one EP rank's experts (toolkit/train/engine/moe.py): EP runs resume layout-free.
    experts_split = (saved_layout or {}).get("ep", 1) > 1
    if not same or experts_split:
        if layout_free is None:
            written = describe(saved_layout) if saved_layout else f"{marker['world_size']} ranks"
            this_run = describe(layout) if layout else f"{dist.get_world_size()} ranks"
            raise DsmtError(
                f"checkpoint {tag} was written at {written}, this run is {this_run}; this model "
                "trains as a plain HF model (no megatron-core adapter), whose checkpoints resume only at the layout "
                "that wrote them: resume with that layout, or start a new output_dir from the exported final-hf")
        record = layout_free.load(tag_dir)
        if not same:
            return Resumed(step=int(marker["step"]),
                           resharded=f"from {describe(record['layout'])} to {describe(layout)}")
        step = int(marker["step"])
    else:
        if layout_free is not None and (tag_dir / "dsmt_layout.json").is_file():
            layout_free.check(tag_dir)  # the same layout, another model: a named error before DeepSpeed's own
        _, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
        step = int(client_state["dsmt_step"])
    # The writer's ranks are this run's: their RNG streams carry over.
    restore_rng_states(torch.load(tag_dir / f"dsmt_rng_rank{dist.get_rank()}.pt"))
    return Resumed(step=step)
