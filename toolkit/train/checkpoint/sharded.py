"""The optimizer state of a checkpoint, fully sharded and layout-free: every rank writes exactly its ZeRO share of
the fp32 master weights and both Adam moments, and reads back exactly the share its new layout needs.

    <tag>/state/rank_00003.safetensors   rank 3's fragments, as boxes of the layout-free tensors
                                         (`master/<key>/<offset>`, `exp_avg/...`, `exp_avg_sq/...`)
    <tag>/state/index.json               every saved box: file, layout-free key, offset, shape; each key's shape

Nothing is gathered: a rank's fragment comes from DeepSpeed's own bookkeeping (`_hp_mapping` at ZeRO-1/2 and in
the bf16 optimizer, the partition of a ZeRO-3 parameter; without a ZeRO wrapper, each DP rank writes 1/DP of the
parameter it holds whole) and is placed in the layout-free tensors by toolkit/train/checkpoint/fragments.py. So the
bytes written per rank are its shard (12 bytes per trainable parameter / ZeRO's DP size), on every rank, and a
resume at any TP / PP / DP / EP / ZeRO stage reads, per rank, the boxes that meet the fragments it holds now: at
the same layout, exactly its own file.

The model's low-precision weights are not saved: they are the master weights rounded, as at the end of every
optimizer step, and a resume makes them so (DeepSpeed's `update_lp_params`, or the ZeRO-3 partition cast)."""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import torch

from toolkit.errors import DsmtError
from toolkit.train.checkpoint.fragments import Box, intersection

STATE_DIR = "state"
INDEX = f"{STATE_DIR}/index.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's, under the names torch, FusedAdam and DeepSpeed's CPU Adam share
STATES = ("master", *MOMENTS)
FORMAT = 1


def rank_file(rank: int) -> str:
    return f"{STATE_DIR}/rank_{rank:05d}.safetensors"


def _label(key: str, box: Box) -> str:
    return f"{key}/{'_'.join(map(str, box.offset))}"


def fragment_range(param, *, loading: bool) -> tuple[int, int]:
    """[start, stop) of the elements of `param` whose optimizer state this rank holds. `loading`: without a ZeRO
    wrapper every DP rank holds the whole parameter and loads all of it (it saves 1/DP of it)."""
    import torch.distributed as dist

    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2 and the bf16 optimizer
        mapping = param._hp_mapping
        if mapping is None:  # no element of this parameter in this rank's partition
            return 0, 0
        start = mapping.lp_fragment_address.start
        return start, start + mapping.lp_fragment_address.numel
    if hasattr(param, "ds_id"):  # ZeRO-3: a partition of ds_tensor.ds_numel elements, the last one padded
        size = param.ds_tensor.ds_numel
        start = min(size * dist.get_rank(group=param.ds_process_group), param.ds_numel)
        return start, min(start + size, param.ds_numel)
    return (0, param.numel()) if loading else _dp_slice(param)


def fragment_values(engine, param, *, start: int, stop: int) -> dict[str, torch.Tensor]:
    """{state: the flat fp32 values of elements [start, stop)}: DeepSpeed's own tensors (views: writing into them
    sets the state), except at ZeRO-3 (see `_commit`)."""
    if start == stop:
        return {}
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping
        return {"master": mapping.hp_fragment, **{name: mapping.get_optim_state_fragment(name) for name in STATES[1:]}}
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        values = {"master": safe_get_local_fp32_param(param),
                  **{name: safe_get_local_optimizer_state(param, name) for name in STATES[1:]}}
        return {name: value.view(-1)[:stop - start] for name, value in values.items()}
    found = _master_of(engine, param)
    if found is not None:  # DeepSpeed's FP16 optimizers (16-bit at ZeRO-0): fp32 masters apart from the parameter
        key, master, offset = found
        state = base_optimizer(engine).state[key]
        values = {"master": master, **{name: state[name].view(-1) for name in STATES[1:]}}
        return {name: value[offset + start:offset + stop] for name, value in values.items()}
    state = base_optimizer(engine).state[param]  # no wrapper: fp32 at ZeRO-0, the parameter is its own master
    values = {"master": param.data.view(-1), **{name: state[name].view(-1) for name in STATES[1:]}}
    return {name: value[start:stop] for name, value in values.items()}


def _master_of(engine, param) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(the tensor Adam's state is keyed by, the flat fp32 masters that hold `param`'s, its offset in them) under
    DeepSpeed's FP16_Optimizer (a fused Adam: one flat fp32 tensor per group, the parameters concatenated without
    padding by `_flatten_dense_tensors`) or FP16_UnfusedOptimizer (one fp32 copy per parameter); None elsewhere."""
    wrapper = engine.optimizer
    masters = getattr(wrapper, "fp32_groups_flat", None) or getattr(wrapper, "fp32_groups", None)
    if masters is None or not hasattr(wrapper, "fp16_groups") or hasattr(wrapper, "checkpoint_event_prologue"):
        return None  # (ZeRO-3 has fp16_groups too, and is handled by its partitions)
    for group, master in zip(wrapper.fp16_groups, masters):
        offset = 0
        for index, member in enumerate(group):
            if member is param and isinstance(master, list):  # unfused: its own fp32 copy
                return master[index], master[index].detach().view(-1), 0
            if member is param:
                return master, master.detach(), offset
            offset += member.numel()
    return None


def _round_masters(wrapper) -> None:
    """The 16-bit weights set from the fp32 masters of DeepSpeed's FP16 optimizers, as their step does."""
    from torch._utils import _unflatten_dense_tensors

    flat = getattr(wrapper, "fp32_groups_flat", None)
    for index, group in enumerate(wrapper.fp16_groups):
        masters = _unflatten_dense_tensors(flat[index].detach(), group) if flat else wrapper.fp32_groups[index]
        for param, master in zip(group, masters):
            param.data.copy_(master.detach())


def base_optimizer(engine):
    """The torch optimizer that holds Adam's state (inside DeepSpeed's ZeRO / bf16 / fp16 wrapper when there is one)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def _dp_slice(param) -> tuple[int, int]:
    """This DP rank's 1/DP of a parameter every DP rank holds whole (its expert-DP group for an expert)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit.parallel.mpu import MegatronMpu

    expert = getattr(param, "allreduce", True) is False
    group = parallel_state.get_expert_data_parallel_group() if expert else MegatronMpu().get_data_parallel_group()
    per = math.ceil(param.numel() / dist.get_world_size(group=group))
    start = min(per * dist.get_rank(group=group), param.numel())
    return start, min(start + per, param.numel())


@dataclasses.dataclass
class Share:
    """One rank's part of a save, taken at the saving step: what its writer writes, and the index entries."""

    file: str
    tensors: dict[str, torch.Tensor]  # name in the file -> host tensor
    boxes: list[dict]  # {"key", "offset", "shape"} of each box written
    shapes: dict[str, list[int]]  # layout-free key -> global shape
    host_bytes: int  # bytes copied to host memory for the writer (0: written from the live state)


def take_share(engine, shards: dict, *, rank: int, copy: bool) -> Share:
    """This rank's fragments of every trainable parameter (`reshard.trainable_shards` with pieces). `copy`: into
    one host buffer, parameter by parameter (a background save: training goes on and changes the live state),
    else the live tensors themselves (written before the next step). State on a GPU is always copied. The buffer
    is pageable, sized to the share: torch's pinned-memory allocator rounds a block up to a power of two and keeps
    it for the rest of the process (up to twice the share, pinned, per rank), and ZeRO-3's accessors return each
    fragment as a new device copy (with its optimizer offloaded too), so each is copied out at once."""
    lay = [(param, fragment_range(param, loading=False), [p for p in pieces if p.written])
           for param, _item, _shape, pieces in shards.values()]
    total = sum(len(STATES) * sum(box.numel for piece in pieces for box, _ in piece.boxes(*span))
                for _, span, pieces in lay)
    buffer = torch.empty(total, dtype=torch.float32) if copy or _on_device(shards) else None
    tensors, boxes, shapes, at = {}, [], {}, 0
    for param, (start, stop), pieces in lay:
        flats = fragment_values(engine, param, start=start, stop=stop)
        for piece in pieces:
            shapes[piece.key] = list(piece.global_shape)
            for box, first in piece.boxes(start, stop):
                boxes.append({"key": piece.key, "offset": list(box.offset), "shape": list(box.shape)})
                for state, flat in flats.items():
                    view = flat.detach()[first - start:first - start + box.numel].view(box.shape)
                    if buffer is not None:
                        view = buffer[at:at + box.numel].view(box.shape).copy_(view)
                        at += box.numel
                    tensors[f"{state}/{_label(piece.key, box)}"] = view
    return Share(file=rank_file(rank), tensors=tensors, boxes=boxes, shapes=shapes,
                 host_bytes=0 if buffer is None else 4 * total)


def _on_device(shards: dict) -> bool:
    return any(param.device.type != "cpu" for param, _item, _shape, _pieces in shards.values())


def write_share(tag_dir: Path, share: Share) -> dict[str, dict]:
    """The writer's work (no collective: a thread may run it): the rank's file, hashed as it is written."""
    from toolkit.train.checkpoint.state_file import write_safetensors

    (Path(tag_dir) / STATE_DIR).mkdir(exist_ok=True)
    return {share.file: write_safetensors(Path(tag_dir) / share.file, share.tensors)}


def index_record(shares: list[tuple[str, list[dict], dict]]) -> dict:
    """The index of every rank's (file, boxes, shapes); each key's boxes must cover it exactly once."""
    shapes, boxes, covered = {}, [], defaultdict(int)
    for file, rank_boxes, rank_shapes in shares:
        shapes.update(rank_shapes)
        for box in rank_boxes:
            boxes.append({"file": file, **box})
            covered[box["key"]] += math.prod(box["shape"])
    wrong = [f"{key}: {covered[key]} of {math.prod(shape)} elements" for key, shape in sorted(shapes.items())
             if covered[key] != math.prod(shape)]
    if wrong:
        raise DsmtError("the ranks' optimizer state does not cover each tensor exactly once (a dsmt bug: report it "
                        "with the layout):\n  " + "\n  ".join(wrong[:5]))
    return {"format": FORMAT, "states": list(STATES), "shapes": dict(sorted(shapes.items())), "boxes": boxes}


class SavedBoxes:
    """The index's boxes of one key, found by their first coordinate (a bisect, not a scan of all of them)."""

    def __init__(self, entries: list[dict]):
        entries = sorted(entries, key=lambda entry: entry["offset"][0] if entry["offset"] else 0)
        self.boxes = [(Box(tuple(e["offset"]), tuple(e["shape"])), e["file"]) for e in entries]
        self.starts = [box.offset[0] if box.offset else 0 for box, _ in self.boxes]
        self.reach, furthest = [], -1  # the largest end of the first coordinate up to each box
        for box, _ in self.boxes:
            furthest = max(furthest, box.offset[0] + box.shape[0] if box.offset else 1)
            self.reach.append(furthest)

    def meeting(self, box: Box):
        """(saved box, file, their intersection) of every saved box that meets `box`."""
        low, high = (box.offset[0], box.offset[0] + box.shape[0]) if box.offset else (0, 1)
        index = bisect.bisect_left(self.starts, high) - 1
        while index >= 0 and self.reach[index] > low:
            saved, file = self.boxes[index]
            common = intersection(box, saved)
            if common is not None:
                yield saved, file, common
            index -= 1


@dataclasses.dataclass(frozen=True)
class Read:
    """One block to read: `common` of saved box `saved` (in `file`), into the parameter's elements from `first`
    on (`box`, the part of this rank's fragment it falls in)."""

    param_index: int
    key: str
    box: Box
    first: int
    saved: Box
    file: str
    common: Box


def plan_reads(shards: dict, index: dict) -> list[Read]:
    """Every block this rank reads to set its fragments of every trainable parameter, after checking that they
    cover each fragment exactly (a named error listing the parameters that would be left unset)."""
    by_key = defaultdict(list)
    for entry in index["boxes"]:
        by_key[entry["key"]].append(entry)
    saved = {key: SavedBoxes(entries) for key, entries in by_key.items()}
    reads, short = [], []
    for param_index, (name, (param, _item, _shape, pieces)) in enumerate(shards.items()):
        start, stop = fragment_range(param, loading=True)
        found = 0
        for piece in pieces:
            for box, first in piece.boxes(start, stop):
                for saved_box, file, common in saved.get(piece.key, SavedBoxes([])).meeting(box):
                    reads.append(Read(param_index, piece.key, box, first, saved_box, file, common))
                    found += common.numel
        if found != stop - start:
            short.append(f"{name}: {found} of its {stop - start} elements in the checkpoint")
    if short:
        raise DsmtError("the checkpoint's optimizer state lacks parts this run needs (a damaged index, or a dsmt "
                        "bug):\n  " + "\n  ".join(short[:5]))
    return reads


def files_read(reads: list[Read]) -> dict[str, int]:
    """file -> the bytes this rank reads of it (fp32, every state)."""
    counts = defaultdict(int)
    for read in reads:
        counts[read.file] += 4 * len(STATES) * read.common.numel
    return dict(counts)


def load_share(engine, shards: dict, tag_dir: Path, reads: list[Read]) -> None:
    """Set this rank's fragments of the master weights and both moments from `reads` (`plan_reads`), one
    parameter at a time (each parameter's files are closed after it, so their mapped pages leave memory), then the
    model's own weights from the masters."""
    by_param = defaultdict(list)
    for read in reads:
        by_param[read.param_index].append(read)
    wrapper = engine.optimizer
    zero3 = hasattr(wrapper, "checkpoint_event_prologue")
    if zero3:  # every parameter partitioned first: gathered ones (the persistent small ones) would keep old data
        wrapper.checkpoint_event_prologue()
    with torch.no_grad():  # DeepSpeed's fp32 partitions are leaves that require grad
        _load_params(engine, shards, tag_dir, by_param)
    if zero3:  # the persistent parameters gathered again from their new partitions (collective)
        wrapper.checkpoint_event_epilogue()
    elif hasattr(wrapper, "update_lp_params"):  # ZeRO-1/2, bf16: each rank's partition rounded, all-gathered
        wrapper.update_lp_params()
    elif hasattr(wrapper, "fp16_groups"):  # FP16_Optimizer / FP16_UnfusedOptimizer
        with torch.no_grad():
            _round_masters(wrapper)


def _load_params(engine, shards: dict, tag_dir: Path, by_param: dict) -> None:
    from contextlib import ExitStack

    from safetensors import safe_open

    for param_index, (param, _item, _shape, _pieces) in enumerate(shards.values()):
        start, stop = fragment_range(param, loading=True)
        flats = fragment_values(engine, param, start=start, stop=stop)
        with ExitStack() as stack:
            opened = {}
            for read in by_param.get(param_index, []):
                if read.file not in opened:
                    opened[read.file] = stack.enter_context(safe_open(Path(tag_dir) / read.file, "pt"))
                for state, flat in flats.items():
                    target = flat[read.first - start:read.first - start + read.box.numel].view(read.box.shape)
                    value = opened[read.file].get_slice(f"{state}/{_label(read.key, read.saved)}")
                    target[read.common.slices(read.box)].copy_(value[read.common.slices(read.saved)])
        _commit(param, flats, count=stop - start)


def _commit(param, flats: dict, *, count: int) -> None:
    """ZeRO-3: the values through DeepSpeed's setters (its fp32 partition may live elsewhere, e.g. offloaded),
    and the parameter's own partition rounded from the master. Elsewhere the fragments were DeepSpeed's own."""
    if not hasattr(param, "ds_id") or count == 0:  # (ZeRO-3 gives the last ranks no element of a small tensor)
        return
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    padded = {}
    for state, value in flats.items():
        padded[state] = torch.zeros(param.ds_tensor.ds_numel, dtype=value.dtype, device=value.device)
        padded[state][:count] = value
    safe_set_local_fp32_param(param, padded["master"])
    for state in STATES[1:]:
        safe_set_local_optimizer_state(param, padded[state], state)
    param.ds_tensor.data.copy_(padded["master"].to(param.ds_tensor.dtype))
