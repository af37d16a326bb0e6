"""dsmt megatron checkpoint -> HF checkpoint directory that `transformers` loads (bit-exact round trip).

Streamed tensor by tensor, in one process and without a process group or a model. Every safetensors header is
written first, from the shapes the weight table gives; then each HF tensor is allocated once and its rows are read
straight from the torch_dist files into it (`rows.py` says which megatron rows make which HF rows, e.g. the q rows
of every query group of a fused QKV), and it is written at its offset. Peak memory is one HF tensor per writer
thread (`workers`), whatever the model size and the layout the checkpoint was saved from. Tensors the model does
not load but the checkpoint keeps (`hf_passthrough.safetensors`, toolkit/convert/passthrough.py) follow the table's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from toolkit.adapters import transforms
from toolkit.adapters.family import AdapterError, LoadItem
from toolkit.adapters.hf_config import ModelSettings
from toolkit.convert import checkpoint as ckpt
from toolkit.convert.mcore_reader import PER_LAYER_KEY, STACKED_EXPERTS, McoreReader
from toolkit.convert.passthrough import entries_of, stored_passthrough
from toolkit.convert.progress import ConversionSummary, byte_progress, peak_rss_bytes
from toolkit.convert.raw_io import HfEntry, tensor_nbytes, write_tensor_files
from toolkit.convert.rows import hf_blocks, megatron_blocks

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")


def export_plan(*, reader: McoreReader, settings: ModelSettings,
                dtypes: dict[str, torch.dtype]) -> list[tuple[LoadItem, list[HfEntry]]]:
    """Per table row, the HF tensors it becomes (name, shape, dtype), after checking the checkpoint's tensors
    against the table both ways; one AdapterError lists every problem."""
    items = settings.load_items()
    ctx = settings.shape_context()
    problems = [f"weight table row {name!r} has no tensor in {reader.model_dir}"
                for name in items if not reader.has(name)]
    table_keys = {reader.locate(name)[0] for name in items}
    problems += [f"checkpoint tensor {key!r} has no row in the {settings.family.model_type} weight table"
                 for key in reader.stored_keys() if key not in table_keys]
    problems += [stacking_problem(key, stacked=reader.stacked_sizes(key, axes=len(axes)), axes=axes, settings=settings)
                 for key in sorted(table_keys & set(reader.stored_keys())) if (axes := stacked_axes(key))]
    problems = [problem for problem in problems if problem]
    if problems:
        raise AdapterError("cannot export:\n  - " + "\n  - ".join(problems))
    plan = []
    for name, item in items.items():
        stored_dtype = reader.dtype(name)
        shapes = [transforms.hf_storage_shape(shape, transposed=item.transposed)
                  for shape in transforms.expected_hf_shapes(item.kind, reader.shape(name), ctx=ctx)]
        plan.append((item, [(hf_name, tuple(shape), dtypes.get(hf_name, stored_dtype))
                            for hf_name, shape in zip(item.hf, shapes)]))
    return plan


def stacked_axes(key: str) -> tuple[str, ...]:
    """The stacked leading axes of a stored key: ("layers",), ("layers", "experts") for an expert's, ("experts",)
    for an expert's key of one layer (dense and MoE layers mixed), () for any other key."""
    per_layer = PER_LAYER_KEY.match(key)
    if per_layer:
        return ("experts",) if key[per_layer.end():].startswith(STACKED_EXPERTS) else ()
    if not key.startswith(("decoder.layers.", "encoder.layers.")):
        return ()
    return ("layers", "experts") if key.split(".layers.", 1)[1].startswith(STACKED_EXPERTS) else ("layers",)


def stacking_problem(key: str, *, stacked: tuple[int, ...], axes: tuple[str, ...], settings: ModelSettings) -> str:
    """A problem line when a key's stacked sizes are not the config's layers / experts ("" when they are)."""
    expected = tuple({"layers": settings.num_layers, "experts": settings.num_experts}[axis] for axis in axes)
    if stacked == expected:
        return ""
    def describe(sizes):
        return " x ".join(f"{size} {axis}" for size, axis in zip(sizes, axes))
    return f"checkpoint tensor {key!r} stacks {describe(stacked)}, the config has {describe(expected)}"


def passthrough_after(names: list[str], *, table: list[str], path: Path) -> list[str]:
    """The passthrough file's names, none of them also made by the weight table."""
    both = sorted(set(names) & set(table))
    if both:
        raise AdapterError(f"{path} holds {', '.join(both)}, which the weight table also exports; the file should "
                           "hold only tensors the model does not load: re-convert the HF checkpoint")
    return names


def plan_shards(entries: list[HfEntry], *, max_shard_bytes: int) -> list[list[int]]:
    """Indices of `entries` per shard, in order: a new shard starts when the next tensor would pass the limit."""
    shards, current, current_bytes = [], [], 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = tensor_nbytes(shape, dtype)
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    return shards + [current]


def tensor_maker(*, item: LoadItem, hf_index: int, entry: HfEntry, reader: McoreReader, ctx):
    """A function making HF tensor `entry` (name, shape, dtype), number `hf_index` of the table row `item`."""
    _, shape, dtype = entry

    def make() -> torch.Tensor:
        if item.transposed or item.expert_slice is not None:  # Conv1D [in, out] or an expert's slice of a stacked
            # tensor: the whole megatron tensor, split, transposed
            tensor = transforms.to_hf(item.kind, reader.get(item.megatron), ctx=ctx)[hf_index]
            return transforms.to_hf_storage(tensor, transposed=item.transposed).to(dtype).contiguous()
        out = torch.empty(shape, dtype=dtype)
        hf_rows = [s[0] for s in transforms.expected_hf_shapes(item.kind, reader.shape(item.megatron), ctx=ctx)]
        for block in hf_blocks(megatron_blocks(item.kind, hf_rows=hf_rows, ctx=ctx), hf_index=hf_index):
            reader.read_rows(item.megatron, start=block.megatron_start,
                             into=out[block.hf_start:block.hf_start + block.num_rows])
        return out

    return make


def table_tensors(plan: list[tuple[LoadItem, list[HfEntry]]], *, reader: McoreReader,
                  ctx) -> tuple[list[HfEntry], list[Callable[[], torch.Tensor]]]:
    """The HF tensors the table's rows make, each with its maker. The experts' slices of a tensor that stacks them
    (`LoadItem.expert_slice`: GPT-OSS's experts.gate_up_proj) become that one tensor [E, ...], made in expert order."""
    parts: dict[str, list[tuple[int | None, HfEntry, Callable]]] = {}
    for item, outputs in plan:
        for i, entry in enumerate(outputs):
            make = tensor_maker(item=item, hf_index=i, entry=entry, reader=reader, ctx=ctx)
            parts.setdefault(entry[0], []).append((item.expert_slice, entry, make))
    entries, makers = [], []
    for name, found in parts.items():
        if found[0][0] is None:
            entries.append(found[0][1])
            makers.append(found[0][2])
            continue
        found.sort(key=lambda part: part[0])
        if [expert for expert, _, _ in found] != list(range(len(found))):
            raise AdapterError(f"{name}: expert slices {[expert for expert, _, _ in found]} do not stack 0..E-1")
        _, shape, dtype = found[0][1]
        entries.append((name, (len(found), *shape), dtype))
        makers.append(lambda makers=[make for _, _, make in found]: stack_experts(makers))
    return entries, makers


def stack_experts(makers: list[Callable[[], torch.Tensor]]) -> torch.Tensor:
    """The experts' slices made one at a time into one [E, ...] tensor: at most that tensor and one expert in memory
    (torch.stack of a list would hold every slice and the stack, ~8 GB per gpt-oss-120b gate_up_proj)."""
    first = makers[0]()
    stacked = torch.empty((len(makers), *first.shape), dtype=first.dtype)
    stacked[0] = first
    for expert, make in enumerate(makers[1:], start=1):
        stacked[expert] = make()
    return stacked


def shard_files(num_shards: int) -> list[str]:
    return (["model.safetensors"] if num_shards == 1 else
            [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)])


def write_safetensors(makers: list[Callable[[], torch.Tensor]], *, entries: list[HfEntry], out_dir: Path,
                      max_shard_bytes: int, workers: int = 1, on_written: Callable[[int], None] = lambda n: None,
                      progress: Callable[[str], None] | None = None) -> int:
    """Write HF-style shards (model-0000i-of-0000n.safetensors + index, or one model.safetensors) with
    `write_tensor_files`. Returns the number of shards."""
    shards = plan_shards(entries, max_shard_bytes=max_shard_bytes)
    files = shard_files(len(shards))
    write_tensor_files(makers, entries=entries, files=[(out_dir / name, indices) for name, indices in zip(files, shards)],
                       workers=workers, on_written=on_written, progress=progress)
    if len(shards) > 1:
        weight_map = {entries[i][0]: file_name for file_name, indices in zip(files, shards) for i in indices}
        total = sum(tensor_nbytes(shape, dtype) for _, shape, dtype in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


@torch.no_grad()
def convert_mcore_to_hf(*, mcore_dir: Path, out_dir: Path, overwrite: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, workers: int = 1, show_progress: bool = False,
                        progress: Callable[[str], None] | None = None) -> ConversionSummary:
    """Export a dsmt megatron checkpoint (any layout it was saved from) as an HF directory, streamed."""
    from toolkit.convert.chunks import inspect_checkpoint

    started = time.perf_counter()
    ckpt.refuse_existing(out_dir, overwrite=overwrite)
    info = inspect_checkpoint(mcore_dir)
    if info.kind != "mcore":
        raise ckpt.CheckpointError(f"{mcore_dir} is an HF checkpoint, not a dsmt megatron one; "
                                   "use `dsmt convert hf-to-mcore`")
    ckpt.side_files(info.hf_dir)  # a side file linked outside the checkpoint is refused before any work
    reader = McoreReader(Path(mcore_dir) / "model")
    dtypes = {name: getattr(torch, dtype) for name, dtype in info.hf_tensor_dtypes().items()}
    plan = export_plan(reader=reader, settings=info.settings, dtypes=dtypes)
    ctx = info.settings.shape_context()
    entries, makers = table_tensors(plan, reader=reader, ctx=ctx)
    kept = stored_passthrough(mcore_dir)  # tensors the model does not load, as published: after the table's
    if kept is not None:
        names = passthrough_after(kept.names(), table=[name for name, _, _ in entries], path=kept.path)
        entries += entries_of(kept, names)
        makers += [lambda name=name: kept.get(name) for name in names]
    total_bytes = sum(tensor_nbytes(shape, dtype) for _, shape, dtype in entries)
    try:
        with ckpt.atomic_output_dir(out_dir, overwrite=overwrite, needed_bytes=total_bytes) as temp_dir, \
                byte_progress(total_bytes=total_bytes, description="mcore-to-hf", enabled=show_progress) as advance:
            num_shards = write_safetensors(makers, entries=entries, out_dir=temp_dir, max_shard_bytes=max_shard_bytes,
                                           workers=workers, on_written=advance, progress=progress)
            ckpt.copy_side_files(info.hf_dir, temp_dir)
    finally:
        reader.close()
    return ConversionSummary(direction="mcore-to-hf", out_dir=Path(out_dir), tensors=len(entries), nbytes=total_bytes,
                             files=num_shards, seconds=time.perf_counter() - started,
                             peak_rss_bytes=peak_rss_bytes(), dtype=ckpt.dtype_name(info.params_dtype))
