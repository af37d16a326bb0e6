"""A checkpoint's marker, manifest and files checked at resume as `dsmt checkpoint verify` checks them
(toolkit/train/checkpoint/manifest.py), the files hashed by every rank in parallel, and what happens when something
differs: the damaged file and tag named, then the next older checkpoint taken, or the named error with
`--no-fallback`."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError

SHOWN = 5  # damaged files listed in one message


class CheckpointDamaged(DsmtError):
    """A checkpoint whose marker, manifest or files are damaged (rule `checkpoint_damaged`)."""


def verdict_collectively(tag_dir: Path, *, reads=None) -> tuple[str, list[str]]:
    """(`manifest.judge`'s verdict on `tag_dir`, every problem one line each): the checks of `dsmt checkpoint
    verify`, with the hashing shared by the ranks. Rank 0 reads the marker and the manifest for all (NFS directory
    caches may differ between nodes); the same answer on every rank. `reads(tag_dir)` (collective): {relpath:
    bytes} this rank will read, or None; when every rank answers, only the files some rank reads are hashed, each
    by one of its readers (the least loaded), so no byte is read twice and no rank reads what another node alone
    needs; else every file, shared by size. Collective."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import manifest

    rank, world = dist.get_rank(), dist.get_world_size()
    shared = [None]
    if rank == 0:  # whatever goes wrong reading them is a damaged checkpoint on every rank, never a hang
        try:
            entries, problems = manifest.expected(tag_dir)
            shared = [(entries, [p.line() for p in problems])]
        except (DsmtError, OSError, KeyError, TypeError, ValueError) as err:
            shared = [(None, [f"{manifest.MANIFEST}: unreadable ({type(err).__name__}: {err})"])]
    dist.broadcast_object_list(shared, src=0)
    entries, extra = shared[0]
    if entries is None:  # no manifest: written before dsmt wrote them (no lines), or damage (lines)
        return manifest.judge(entries=None, problems=extra), extra
    mine = _files_to_check(tag_dir, entries=entries, reads=reads, rank=rank, world=world)
    found = [p.line() for p in manifest.check_entries(tag_dir, {n: entries[n] for n in mine})]
    parts: list = [None] * world
    dist.all_gather_object(parts, found)
    problems = sorted(line for part in parts for line in part) + extra
    return manifest.judge(entries=entries, problems=problems), problems


def _files_to_check(tag_dir: Path, *, entries: dict, reads, rank: int, world: int) -> list[str]:
    """This rank's files to hash: of those it reads when `reads` says (see `verdict_collectively`), else its
    `manifest.share` of all. Collective."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import manifest

    wanted = reads(tag_dir) if reads is not None else None
    every: list = [None] * world
    dist.all_gather_object(every, wanted)
    if any(part is None for part in every):
        names = sorted(entries)
        return manifest.share(names, [entries[n]["size"] for n in names], rank=rank, world_size=world)
    return readers_share(every, entries=entries, rank=rank)


def readers_share(reads_by_rank: list[dict], *, entries: dict, rank: int) -> list[str]:
    """The files `rank` hashes: each file some rank reads goes to the reader with the fewest bytes so far,
    largest files first (ties: the lower rank): the same on every rank, each file once. Files no rank reads are
    not hashed; a name outside the manifest is not this check's (the manifest's own check names missing files)."""
    from toolkit.train.checkpoint.manifest import balanced

    read = {name: entries[name]["size"] for part in reads_by_rank for name in part if name in entries}
    return balanced(read, candidates=lambda name: [r for r, part in enumerate(reads_by_rank) if name in part],
                    rank=rank, world_size=len(reads_by_rank))


def refuse_or_fall_back(*, tag: str, problems: list[str], older: str | None, fallback: bool,
                        checkpoint_dir: Path) -> None:
    """Say that `tag` is damaged and return (the caller takes `older`), or raise when there is nothing to fall back
    to or `fallback` is off. Every rank calls it with the same arguments."""
    import torch.distributed as dist

    listed = "\n  ".join(problems[:SHOWN]) + (f"\n  ... {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    damaged = f"checkpoint {checkpoint_dir / tag} is damaged (files, manifest or completion marker):\n  {listed}"
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
