"""A checkpoint's files against its manifest (toolkit/train/checkpoint/manifest.py) at resume, hashed by every rank
in parallel, and what happens when they differ: the damaged file and tag named, then the next older checkpoint
taken, or the named error with `--no-fallback`."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError

SHOWN = 5  # damaged files listed in one message


class CheckpointDamaged(DsmtError):
    """A checkpoint whose files do not match its manifest (rule `checkpoint_damaged`)."""


def problems_collectively(tag_dir: Path) -> list[str]:
    """Every difference between `tag_dir`'s files and its manifest, one line each (empty: intact, or a tag written
    before dsmt wrote manifests). The same list on every rank. Collective."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import manifest

    rank, world = dist.get_rank(), dist.get_world_size()
    shared = [None]
    if rank == 0:  # a manifest that cannot be read is a damaged checkpoint, on every rank (never a hang)
        try:
            entries, problems = manifest.expected(tag_dir)
            shared = [(entries, [p.line() for p in problems])]
        except (DsmtError, OSError, KeyError, TypeError, ValueError) as err:
            shared = [({}, [f"{manifest.MANIFEST}: unreadable ({type(err).__name__}: {err})"])]
    dist.broadcast_object_list(shared, src=0)
    entries, extra = shared[0]
    if entries is None:  # no manifest: written before dsmt wrote them (no lines), or one deleted (a line)
        return extra
    names = sorted(entries)
    mine = manifest.share(names, [entries[n]["size"] for n in names], rank=rank, world_size=world)
    found = [p.line() for p in manifest.check_entries(tag_dir, {n: entries[n] for n in mine})]
    parts: list = [None] * world
    dist.all_gather_object(parts, found)
    return sorted(line for part in parts for line in part) + extra


def refuse_or_fall_back(*, tag: str, problems: list[str], older: str | None, fallback: bool,
                        checkpoint_dir: Path) -> None:
    """Say that `tag` is damaged and return (the caller takes `older`), or raise when there is nothing to fall back
    to or `fallback` is off. Every rank calls it with the same arguments."""
    import torch.distributed as dist

    listed = "\n  ".join(problems[:SHOWN]) + (f"\n  ... {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    damaged = f"checkpoint {checkpoint_dir / tag} does not match its manifest:\n  {listed}"
    verify = f"`dsmt checkpoint verify {checkpoint_dir}` lists every checkpoint's state"
    if not fallback:
        raise CheckpointDamaged(f"[checkpoint_damaged] {damaged}\nfix: restore the file(s) from a copy, or resume "
                                f"without --no-fallback to take the newest intact checkpoint; {verify}")
    if older is None:
        raise CheckpointDamaged(f"[checkpoint_damaged] {damaged}\nand no older complete checkpoint is left to "
                                f"resume from\nfix: restore the file(s), or move {checkpoint_dir} aside to start "
                                f"from the model; {verify}")
    if dist.get_rank() == 0:
        print(f"dsmt train: {damaged}\ndsmt train: falling back to {older}, the next older checkpoint (the steps "
              f"after it are trained again; --no-fallback stops instead)", flush=True)
