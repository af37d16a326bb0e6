"""Training checkpoints: DeepSpeed's engine checkpoint (model, optimizer, scheduler) plus dsmt's own record of
what makes a resumed run identical (step, per-rank RNG), and a completion marker written last.

    <output_dir>/checkpoints/step_000010/        DeepSpeed's files for tag step_000010
    <output_dir>/checkpoints/step_000010/dsmt_rng_rank{r}.pt
    <output_dir>/checkpoints/step_000010/dsmt_complete.json   written by rank 0 after every rank has saved
    <output_dir>/checkpoints/latest_complete     the newest complete tag (replaced atomically)

A run killed while saving leaves a tag without `dsmt_complete.json`; resume never takes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

COMPLETE_MARKER = "dsmt_complete.json"
LATEST = "latest_complete"


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def save(*, engine, checkpoint_dir: Path, step: int) -> None:
    import torch.distributed as dist

    tag = tag_for(step)
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"dsmt_step": step}, save_latest=False)
    rank = dist.get_rank()
    torch.save({"torch": torch.get_rng_state()}, Path(checkpoint_dir) / tag / f"dsmt_rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (Path(checkpoint_dir) / tag / COMPLETE_MARKER).write_text(json.dumps({"step": step, "world_size": dist.get_world_size()}))
        temp = Path(checkpoint_dir) / f".{LATEST}.tmp"
        temp.write_text(tag)
        os.replace(temp, Path(checkpoint_dir) / LATEST)
    dist.barrier()


def latest_complete(checkpoint_dir: Path) -> str | None:
    """The newest tag with a completion marker (the `latest_complete` pointer, else a scan)."""
    checkpoint_dir = Path(checkpoint_dir)
    pointer = checkpoint_dir / LATEST
    if pointer.is_file() and (checkpoint_dir / pointer.read_text().strip() / COMPLETE_MARKER).is_file():
        return pointer.read_text().strip()
    tags = sorted(p.parent.name for p in checkpoint_dir.glob(f"step_*/{COMPLETE_MARKER}"))
    return tags[-1] if tags else None


def resume(*, engine, checkpoint_dir: Path) -> int:
    """Load the newest complete checkpoint; returns the number of steps already done (0 when none)."""
    import torch.distributed as dist

    tag = latest_complete(checkpoint_dir)
    if tag is None:
        return 0
    marker = json.loads((Path(checkpoint_dir) / tag / COMPLETE_MARKER).read_text())
    if marker["world_size"] != dist.get_world_size():
        from toolkit.errors import DsmtError

        raise DsmtError(
            f"checkpoint {tag} was written by {marker['world_size']} ranks, this run has {dist.get_world_size()}; "
            "DeepSpeed engine checkpoints are tied to the layout: resume with the same layout, or start from the "
            "exported HF / dsmt megatron checkpoint"
        )
    _, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
    rng = torch.load(Path(checkpoint_dir) / tag / f"dsmt_rng_rank{dist.get_rank()}.pt")
    torch.set_rng_state(rng["torch"])
    return int(client_state["dsmt_step"])
