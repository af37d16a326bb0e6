"""Training checkpoints: each rank's share of the training state, dsmt's record of what makes a resumed run
identical (step, counters, LR schedule, per-rank RNG), a manifest of digests and a completion marker written last.

    <output_dir>/checkpoints/step_000010/state/rank_{r:05d}.safetensors   rank r's ZeRO share of the fp32 master
                                                 weights and Adam moments (toolkit/train/checkpoint/sharded.py)
    <output_dir>/checkpoints/step_000010/state/index.json, dsmt_layout.json   where each share lies; the record
    <output_dir>/checkpoints/step_000010/dsmt_rng_rank{r}.pt
    <output_dir>/checkpoints/step_000010/hf/     at training.export_hf_interval: the model as transformers loads it
    <output_dir>/checkpoints/step_000010/dsmt_manifest.json   every file's size and xxh3-128 digest
    <output_dir>/checkpoints/step_000010/dsmt_complete.json   written by rank 0 after every rank has saved
    <output_dir>/checkpoints/latest_complete     the newest complete tag (replaced atomically): a hint only

Every rank writes its own share and nothing is gathered: the bytes of a save are spread over all ranks, and each
rank's files are hashed as they are written (toolkit/train/checkpoint/state_file.py). With `training.async_save`
the saving step only copies the share to host memory and a thread writes it (toolkit/train/checkpoint/writer.py).
A plain HF model (no megatron-core adapter) is saved as DeepSpeed's engine checkpoint instead, synchronously.

A save writes into `.partial-step_000010/` and rank 0 renames it to `step_000010/` once the manifest and the marker
are in (toolkit/train/checkpoint/manifest.py); a resume checks the marker, the manifest and the files each rank
will read (each file hashed once, by one of its readers) and falls back to the next older checkpoint when one is
damaged (toolkit/train/checkpoint/integrity.py); `dsmt checkpoint verify` checks every file. A resume takes the
newest tag that passes, whatever `latest_complete` names (a pointer naming another tag is said, not followed).
Pickles (the RNG files, an older checkpoint's DeepSpeed files) are read with torch's weights-only loader
(toolkit/train/checkpoint/pickles.py): a checkpoint cannot run code.

A run resumes from the sharded state at any layout (TP, PP, VPP, CP, DP, EP, ZeRO stage; each rank reads the
blocks its fragments need, at the same layout exactly its own file) and keeps its RNG streams at the same layout.
A checkpoint of an older dsmt (DeepSpeed's files and a layout-free/ copy) resumes as it did: through DeepSpeed at
the layout that wrote it, else from its layout-free copy (toolkit/train/checkpoint/reshard.py). Nothing in a
checkpoint is ever modified by a resume.

A run killed while saving leaves a `.partial-*` folder (or, from older dsmt, a tag without `dsmt_complete.json`);
resume never takes it, and it is removed before the next save and at resume. With `training.keep_checkpoints: K`,
rank 0 renames the oldest complete tags beyond the newest K out of the way after each save and deletes them in a
thread (no rank waits in a collective for a deletion of terabytes).

The per-rank RNG file: toolkit/train/checkpoint/rng.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import torch

from toolkit.launch.rank0 import on_rank0
from toolkit.train.checkpoint.folders import (COMPLETE_MARKER, PARTIAL, PRUNING, checkpoint_io_error, publish,
                                              remove_in_background, remove_leftovers, set_aside_damaged, tag_order,
                                              tag_step, wait_for_removals, write_small)
from toolkit.train.checkpoint import manifest
from toolkit.train.checkpoint.manifest import LATEST, marker_text, pointer_note, read_marker
from toolkit.train.checkpoint.pickles import deepspeed_loads_weights_only, refuse_unsafe
from toolkit.train.checkpoint.rng import restore_rng_states, rng_states


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def save(*, engine, checkpoint_dir: Path, step: int, keep_checkpoints: int | None = None, layout: dict | None = None,
         layout_free=None, background: bool = False, also_write=None) -> None:
    """Collective. `layout`: `reshard.layout_record` of this run (kept in the marker); `layout_free`: a
    `reshard.LayoutFreeState` whose sharded state is the checkpoint (None: a plain HF model, saved as DeepSpeed's
    engine checkpoint). `background`: return once the state is in host memory; the files are written by a thread
    and the save completes at a later step (toolkit/train/checkpoint/writer.py). `also_write(partial_dir)`:
    collective, run during the save; what it writes under the folder is part of the checkpoint.

    Everything is written into `.partial-<tag>/` first; rank 0 adds the manifest and the completion marker, then
    renames it to `<tag>/`: a kill or a full disk at any point leaves no `<tag>/` a later save or resume trips on,
    and the leftover is removed before the next save (and at resume)."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import space, writer

    writer.wait()  # at most one save in flight: the previous one completes (or raises) first
    checkpoint_dir, tag = Path(checkpoint_dir), tag_for(step)
    partial, started = checkpoint_dir / f"{PARTIAL}{tag}", time.perf_counter()
    refusal, needed = on_rank0(lambda: _prepare_save(checkpoint_dir, tag=tag), what=f"preparing to save {tag}",
                               os_error=checkpoint_io_error)
    if refusal:  # every rank takes the same branch
        raise space.DiskFull(refusal)
    record = {"step": step, "world_size": dist.get_world_size(), "layout": layout, "manifest": True}
    if layout_free is None:
        _save_engine(engine, partial=partial, step=step, record=record, keep_checkpoints=keep_checkpoints,
                     also_write=also_write, started=started, needed=needed)
        return
    share, state_record = layout_free.take(copy=background)
    _refuse_unless_it_fits(partial, share_bytes=sum(t.numel() * t.element_size() for t in share.tensors.values()))
    rng = rng_states()
    if also_write is not None:
        also_write(partial)
    finish = functools.partial(_finish_sharded, partial=partial, tag=tag, record={**record, "state": "sharded"},
                               state_record=state_record, keep_checkpoints=keep_checkpoints, started=started)
    pending = writer.PendingSave(partial=partial, tag=tag, finish=finish, started=started,
                                 needed=needed,
                                 shared={"file": share.file, "boxes": share.boxes, "shapes": share.shapes,
                                         "host_bytes": share.host_bytes})
    writer.start(pending, functools.partial(_write_rank_files, partial, share=share, rng=rng), background=background)


def wait_for_save() -> None:
    """Collective: a save still in flight completed (or its error raised on every rank)."""
    from toolkit.train.checkpoint import writer

    writer.wait()


def finish_save_if_written() -> None:
    """Collective, after each training step: a background save completed once every rank has written its files."""
    from toolkit.train.checkpoint import writer

    writer.finish_if_written()


def _refuse_unless_it_fits(partial: Path, *, share_bytes: int) -> None:
    """The named `disk_full` on every rank, before a byte of the state is written, when the filesystem has not
    room for every rank's share (known here, unlike the size of a first save of DeepSpeed's files). Collective."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import space

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, share_bytes)
    refusal = on_rank0(lambda: space.copy_refusal(directory=partial, needed=sum(every)),
                       what=f"checking the free space for {partial}", os_error=checkpoint_io_error)
    if refusal:
        raise space.DiskFull(refusal)


def _write_rank_files(partial: Path, *, share, rng: dict) -> dict:
    """This rank's files of the save, hashed as they are written (no collective: the writer thread runs it);
    rank 0 also hashes what `also_write` put in the folder. Returns {relpath: manifest entry}."""
    import torch.distributed as dist

    from toolkit.train.checkpoint.sharded import write_share
    from toolkit.train.checkpoint.state_file import save_hashed

    rank = dist.get_rank()
    entries = write_share(partial, share)
    entries[f"dsmt_rng_rank{rank}.pt"] = save_hashed(rng, partial / f"dsmt_rng_rank{rank}.pt")
    if rank == 0 and (partial / "hf").is_dir():  # the HF export: read back once, by rank 0
        entries.update(manifest.entries_for(partial, [name for name in manifest.list_files(partial)
                                                      if name.startswith("hf/")]))
    return entries


def _finish_sharded(outcomes: list[dict], *, partial: Path, tag: str, record: dict, state_record: dict,
                    keep_checkpoints: int | None, started: float) -> None:
    """Collective, once every rank's files are written: rank 0 writes the index, the record, the manifest and the
    marker, and publishes the tag."""
    import torch.distributed as dist

    from toolkit.train.checkpoint.reshard import RECORD
    from toolkit.train.checkpoint.sharded import INDEX, index_record
    from toolkit.train.checkpoint.state_file import HashedFile

    def complete() -> int:
        entries = {name: entry for outcome in outcomes for name, entry in outcome["entries"].items()}
        index = index_record([(o["shared"]["file"], o["shared"]["boxes"], o["shared"]["shapes"]) for o in outcomes])
        for name, content in ((INDEX, index), (RECORD, state_record)):
            with HashedFile(partial / name) as out:
                out.write(json.dumps(content, indent=None).encode())
            entries[name] = out.entry()
        manifest.write_manifest(partial, entries)
        _finish_save(partial, tag=tag, record=record, keep_checkpoints=keep_checkpoints)
        return sum(entry["size"] for entry in entries.values())

    total = on_rank0(complete, what=f"completing {tag}", os_error=checkpoint_io_error)
    if dist.get_rank() == 0:
        host = max(o["shared"]["host_bytes"] for o in outcomes)
        print(f"dsmt: checkpoint {tag}: {total / 1e6:,.1f} MB from {len(outcomes)} ranks in "
              f"{time.perf_counter() - started:.2f} s, training blocked {max(o['blocked_s'] for o in outcomes):.2f} "
              f"s, {host / 1e6:,.1f} MB copied to host memory per rank at most", flush=True)


def _save_engine(engine, *, partial: Path, step: int, record: dict, keep_checkpoints: int | None, also_write,
                 started: float, needed: int | None) -> None:
    """A plain HF model's checkpoint: DeepSpeed's engine checkpoint and the RNG states, synchronously. `needed`:
    the previous checkpoint's bytes (`_prepare_save`)."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import space

    checkpoint_dir, tag = partial.parent, partial.name.removeprefix(PARTIAL)
    try:
        engine.save_checkpoint(str(checkpoint_dir), tag=partial.name, client_state={"dsmt_step": step},
                               save_latest=False)
        torch.save(rng_states(), partial / f"dsmt_rng_rank{dist.get_rank()}.pt")
        if also_write is not None:
            also_write(partial)
        dist.barrier()
        total_bytes = write_manifest(partial)
    except Exception as err:
        # The partial folder stays (the other ranks may still write into it): the next start removes it.
        full = space.as_disk_full(err, directory=checkpoint_dir, tag=tag, needed=needed, partial=partial)
        if full is None:
            raise
        raise full from err
    on_rank0(lambda: _finish_save(partial, tag=tag, record=record, keep_checkpoints=keep_checkpoints),
             what=f"completing {tag}", os_error=checkpoint_io_error)
    if dist.get_rank() == 0:
        print(f"dsmt: checkpoint {tag}: {total_bytes / 1e6:,.1f} MB in {time.perf_counter() - started:.2f} s",
              flush=True)


def _prepare_save(checkpoint_dir: Path, *, tag: str) -> tuple[str | None, int | None]:
    """Rank 0, before a save: leftovers of interrupted saves removed, then the free-space check. Returns (why the
    save is refused, None: go on; the previous checkpoint's bytes, what a disk-full message of this save names)."""
    from toolkit.train.checkpoint import space

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(checkpoint_dir)
    needed = _newest_bytes(checkpoint_dir)
    refusal = space.refusal(directory=checkpoint_dir, tag=tag, needed=needed)
    if refusal is not None:  # the space pruned checkpoints free once their deletion ends: waited for only here
        wait_for_removals()
        refusal = space.refusal(directory=checkpoint_dir, tag=tag, needed=needed)
    if refusal is None:
        (checkpoint_dir / f"{PARTIAL}{tag}").mkdir()
    return refusal, needed


def _finish_save(partial: Path, *, tag: str, record: dict, keep_checkpoints: int | None) -> None:
    """Rank 0, once every file and the manifest are written: the marker, the rename, the pointer, the pruning."""
    checkpoint_dir = partial.parent
    write_small(partial / COMPLETE_MARKER, marker_text(partial, record))
    publish(partial, checkpoint_dir / tag)
    write_small(checkpoint_dir / f".{LATEST}.tmp", tag)
    os.replace(checkpoint_dir / f".{LATEST}.tmp", checkpoint_dir / LATEST)
    if keep_checkpoints is not None:
        prune(checkpoint_dir, keep=keep_checkpoints)


def _clear_leftovers(checkpoint_dir: Path) -> None:
    """Rank 0 of the run that holds the directory's lock: what interrupted saves left goes, one line each."""
    for line in remove_leftovers(checkpoint_dir):
        print(f"dsmt: {line}", flush=True)


def _newest_bytes(checkpoint_dir: Path) -> int | None:
    """The size of the newest complete checkpoint (what the next one will take, at the same layout)."""
    from toolkit.train.checkpoint.manifest import tag_bytes

    tags = complete_tags(checkpoint_dir)
    return tag_bytes(Path(checkpoint_dir) / tags[-1]) if tags else None


def write_manifest(partial: Path) -> int:
    """Every file's size and digest into the manifest; each rank hashes its share of the bytes; returns the
    checkpoint's bytes. Every rank lists the folder (the union counts: on NFS one node's directory cache may not
    show another node's new files yet); rank 0 sizes the files by name. Collective."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import manifest

    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list = [None] * world
    dist.all_gather_object(seen, manifest.list_files(partial))
    files = sorted(set().union(*seen))
    sizes = on_rank0(lambda: [(partial / name).stat().st_size for name in files], what=f"sizing {partial}",
                     os_error=checkpoint_io_error)
    entries = manifest.entries_for(partial, manifest.share(files, sizes, rank=rank, world_size=world))
    parts: list = [None] * world
    dist.all_gather_object(parts, entries)
    on_rank0(lambda: manifest.write_manifest(partial, {name: entry for part in parts for name, entry in part.items()}),
             what=f"writing the manifest of {partial}", os_error=checkpoint_io_error)
    return sum(sizes)


def complete_tags(checkpoint_dir: Path) -> list[str]:
    """Tags with a completion marker, oldest first (by step number, not by name: `tag_order`)."""
    tags = [p.parent.name for p in Path(checkpoint_dir).glob(f"step_*/{COMPLETE_MARKER}")]
    return sorted((tag for tag in tags if tag_step(tag) is not None), key=tag_order)


def prune(checkpoint_dir: Path, *, keep: int) -> list[str]:
    """Delete the oldest complete tags beyond the newest `keep`; returns the deleted tags.

    Never deleted: the tag `latest_complete` names and any tag at or after the newest complete one. Incomplete
    tags are not this function's: `remove_leftovers` takes them before each save and at resume."""
    from toolkit.errors import DsmtError

    if keep < 1:
        raise DsmtError(f"keep_checkpoints={keep} must be >= 1 (or null to keep every checkpoint)")
    checkpoint_dir = Path(checkpoint_dir)
    tags = complete_tags(checkpoint_dir)
    pointer = checkpoint_dir / LATEST
    protected = {pointer.read_text().strip() if pointer.is_file() else None, *tags[-keep:]}
    doomed = [t for t in tags[:-keep] if t not in protected]
    for tag in doomed:
        (checkpoint_dir / tag / COMPLETE_MARKER).unlink()  # first: a crash mid-delete leaves an incomplete tag
        aside = checkpoint_dir / f"{PRUNING}{tag}"
        os.replace(checkpoint_dir / tag, aside)
        # in a thread (rank 0's collectives must not wait on it); a reader on another NFS client leaves .nfs* files
        # behind, which the leftovers' removal before a later save takes
        remove_in_background(aside)
    return doomed


def latest_complete(checkpoint_dir: Path) -> str | None:
    """The newest tag with a completion marker, by step number (not checked: `intact_tag` checks). The
    `latest_complete` pointer is not read: it is a hint (see toolkit/train/checkpoint/manifest.py)."""
    tags = complete_tags(checkpoint_dir)
    return tags[-1] if tags else None


@dataclasses.dataclass(frozen=True)
class Resumed:
    step: int  # steps already done (0: a fresh start)
    resharded: str | None = None  # "from LAYOUT to LAYOUT" when the state came from the layout-free copy


def resume(*, engine, checkpoint_dir: Path, layout: dict | None = None, layout_free=None,
           fallback: bool = True, owner: bool = False) -> Resumed:
    """Load the newest intact complete checkpoint: through DeepSpeed at the layout that wrote it, else from its
    layout-free copy (`layout_free`, see `save`). Each candidate's files are checked against its manifest first; a
    damaged one is named and the next older one taken (`fallback=False`: the named error instead). `owner`: this
    run holds the directory's run lock, so it removes interrupted saves and sets damaged checkpoints aside (a
    script reading another run's checkpoints changes nothing). Every rank takes the same branch (rank 0 chooses the
    tag for all and they share the verdict)."""
    import torch.distributed as dist

    reads = layout_free.files_to_read if layout_free is not None else None
    tag = intact_tag(checkpoint_dir, fallback=fallback, owner=owner, reads=reads)
    if tag is None:
        return Resumed(step=0)
    tag_dir = Path(checkpoint_dir) / tag
    marker = read_marker(tag_dir)
    saved_layout = marker.get("layout")
    same = saved_layout == layout if saved_layout is not None else marker["world_size"] == dist.get_world_size()
    # Older dsmt: DeepSpeed's module file keeps one EP rank's experts (toolkit/train/engine/moe.py), so EP runs
    # resumed layout-free; a sharded checkpoint (no DeepSpeed files) always does.
    experts_split = (saved_layout or {}).get("ep", 1) > 1
    if marker.get("state") == "sharded" or not same or experts_split:
        step, resharded = _load_layout_free(tag_dir, marker=marker, layout=layout, layout_free=layout_free, same=same)
        if resharded:
            return Resumed(step=step, resharded=resharded)
    else:
        if layout_free is not None and (tag_dir / "dsmt_layout.json").is_file():
            layout_free.check(tag_dir)  # the same layout, another model: a named error before DeepSpeed's own
        with deepspeed_loads_weights_only(engine):
            _, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag)
        step = int(client_state["dsmt_step"])
    # The writer's ranks are this run's: their RNG streams carry over.
    restore_rng_states(torch.load(tag_dir / f"dsmt_rng_rank{dist.get_rank()}.pt", weights_only=True))
    return Resumed(step=step)


def _load_layout_free(tag_dir: Path, *, marker: dict, layout: dict | None, layout_free, same: bool):
    """(step, "from A to B" or None) after loading the layout-free copy."""
    import torch.distributed as dist

    from toolkit.errors import DsmtError
    from toolkit.train.checkpoint.reshard import describe

    saved_layout = marker.get("layout")
    if layout_free is None:
        written = describe(saved_layout) if saved_layout else f"{marker['world_size']} ranks"
        this_run = describe(layout) if layout else f"{dist.get_world_size()} ranks"
        raise DsmtError(
            f"checkpoint {tag_dir.name} was written at {written}, this run is {this_run}; this model "
            "trains as a plain HF model (no megatron-core adapter), whose checkpoints resume only at the layout "
            "that wrote them: resume with that layout, or start a new output_dir from the exported final-hf")
    record = layout_free.load(tag_dir)
    resharded = None if same else f"from {describe(record['layout'])} to {describe(layout)}"
    return int(marker["step"]), resharded


def intact_tag(checkpoint_dir: Path, *, fallback: bool = True, owner: bool = False, reads=None) -> str | None:
    """The newest complete tag that passes the checks `dsmt checkpoint verify` runs (`integrity.verdict_collectively`:
    marker, manifest, files); None when there is no complete tag. Rank 0 lists the candidates for every rank (on NFS
    two nodes' directory caches may differ); the ranks share the hashing and the verdict. `reads(tag_dir)`: the
    files this rank will read ({relpath: bytes}, collective; None: every file), so that only what is read is
    checked, each file once, by one of its readers. Collective."""
    import torch.distributed as dist

    from toolkit.train.checkpoint import integrity
    from toolkit.train.checkpoint.manifest import USABLE

    checkpoint_dir = Path(checkpoint_dir)
    candidates = on_rank0(lambda: _candidates(checkpoint_dir, owner=owner),
                          what=f"listing the checkpoints in {checkpoint_dir}", os_error=checkpoint_io_error)
    taken = None
    for index, tag in enumerate(candidates):
        started = time.perf_counter()
        status, problems = integrity.verdict_collectively(checkpoint_dir / tag, reads=reads)
        if status in USABLE:
            _say_verified(checkpoint_dir / tag, seconds=time.perf_counter() - started)
            # Not a fallback: a crafted file is no accident of the disk, and a person should look at it.
            on_rank0(lambda: refuse_unsafe(checkpoint_dir / tag), what=f"reading the pickles of {tag}",
                     os_error=checkpoint_io_error)
            taken = tag
            break
        older = candidates[index + 1] if index + 1 < len(candidates) else None
        integrity.refuse_or_fall_back(tag=tag, problems=problems, older=older, fallback=fallback,
                                      checkpoint_dir=checkpoint_dir)
        if owner:
            on_rank0(lambda: _say_set_aside(set_aside_damaged(checkpoint_dir, tag)), what=f"setting {tag} aside",
                     os_error=checkpoint_io_error)
    note = on_rank0(lambda: pointer_note(checkpoint_dir, taken=taken), what=f"reading {checkpoint_dir / LATEST}",
                    os_error=checkpoint_io_error)
    if note and dist.get_rank() == 0:
        print(f"dsmt train: {note}", flush=True)
    return taken


def _candidates(checkpoint_dir: Path, *, owner: bool) -> list[str]:
    """Every complete tag, newest first (the owner first removes what interrupted saves left). Not cut at the
    `latest_complete` pointer: a stale or edited pointer must not rewind a run past an intact newer checkpoint."""
    if owner:
        _clear_leftovers(checkpoint_dir)
    return list(reversed(complete_tags(checkpoint_dir)))


def _say_verified(tag_dir: Path, *, seconds: float) -> None:
    import torch.distributed as dist

    from toolkit.train.checkpoint.manifest import MANIFEST, tag_bytes

    if dist.get_rank() == 0 and (tag_dir / MANIFEST).is_file():
        print(f"dsmt train: {tag_dir.name} matches its manifest ({tag_bytes(tag_dir) / 1e6:,.1f} MB checked in "
              f"{seconds:.2f} s)", flush=True)


def _say_set_aside(aside: Path) -> None:
    print(f"dsmt train: set the damaged checkpoint aside as {aside} (not resumed from, not pruned; delete it once "
          "inspected)", flush=True)
