"""dsmt megatron checkpoint -> HF checkpoint directory that `transformers` loads (bit-exact round trip).

Streamed tensor by tensor, in one process and without a process group or a model: megatron's torch_dist format
is torch.distributed.checkpoint underneath, so each canonical megatron tensor (one layer of a stacked
`decoder.layers.*` key) is read into a preallocated tensor, turned into its HF tensor(s) by the family table's
inverse transforms and appended to a safetensors shard whose header was written from the shapes up front. Peak
memory is a few copies of the largest single tensor, whatever the model size and the layout it was saved from.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from toolkit.adapters import transforms
from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_config import ModelSettings
from toolkit.adapters.hf_source import _SAFETENSORS_DTYPES
from toolkit.adapters.load import LoadItem, expand_table
from toolkit.convert import checkpoint as ckpt

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
SAFETENSORS_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
_LAYER_NAME = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.+)$")  # GPTModel's stack, or an encoder's
HfEntry = tuple[str, tuple[int, ...], torch.dtype]  # HF name, shape, dtype of one exported tensor


class McoreTensorReader:
    """Canonical megatron name (`decoder.layers.7.mlp.linear_fc1.weight`) -> its layout-free tensor, read from a
    torch_dist directory one tensor at a time. megatron stacks the layers of a key on a leading axis
    (`decoder.layers.mlp.linear_fc1.weight` [num_layers, ...]), one stored chunk per layer and TP shard."""

    def __init__(self, model_dir: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.model_dir = Path(model_dir)
        self._reader = FileSystemReader(str(model_dir))
        metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(metadata, True)
        self._stored = {key: md for key, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}  # drops the `_extra_state` byte blobs

    def stored_keys(self) -> list[str]:
        return list(self._stored)

    def locate(self, name: str) -> tuple[str, int | None]:
        """(stored key, layer index or None)."""
        match = _LAYER_NAME.match(name)
        return (f"{match.group(1)}.layers.{match.group(3)}", int(match.group(2))) if match else (name, None)

    def has(self, name: str) -> bool:
        key, layer = self.locate(name)
        return key in self._stored and (layer is None or layer < self._stored[key].size[0])

    def shape(self, name: str) -> tuple[int, ...]:
        key, layer = self.locate(name)
        size = tuple(self._stored[key].size)
        return size if layer is None else size[1:]

    def stacked_layers(self, key: str) -> int:
        return self._stored[key].size[0]

    def dtype(self, name: str) -> torch.dtype:
        return self._stored[self.locate(name)[0]].properties.dtype

    def get(self, name: str) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        from torch.futures import Future

        key, layer = self.locate(name)
        stored = self._stored[key]
        size = tuple(stored.size)
        offsets = [0] * len(size)
        if layer is not None:
            offsets[0], size = layer, (1, *size[1:])
        target = torch.empty(size, dtype=stored.properties.dtype)
        wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(size))
        plan = _Plan(create_read_items_for_chunk_list(key, stored, [wanted]))
        result = self._reader.read_data(plan, _Into(target))
        if isinstance(result, Future):
            result.wait()
        return target[0] if layer is not None else target


class _Plan:
    """The part of torch's LoadPlan that `FileSystemReader.read_data` reads."""

    def __init__(self, items):
        self.items = items


class _Into:
    """The part of torch's LoadPlanner that `read_data` calls: every read lands in a slice of one tensor."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.target
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # `tensor` is the view of `target` that `resolve_tensor` returned, already filled

    def load_bytes(self, read_item, value) -> None:
        raise AdapterError(f"unexpected byte item {read_item.dest_index.fqn!r} while reading tensors")


def export_plan(*, reader: McoreTensorReader, settings: ModelSettings,
                dtypes: dict[str, torch.dtype]) -> list[tuple[LoadItem, list[HfEntry]]]:
    """Per table row, the HF tensors it becomes (name, shape, dtype), after checking the checkpoint's tensors
    against the table both ways; one AdapterError lists every problem."""
    items = expand_table(settings.weight_table(), num_layers=settings.num_layers)
    ctx = settings.shape_context()
    problems = [f"weight table row {name!r} has no tensor in {reader.model_dir}"
                for name in items if not reader.has(name)]
    table_keys = {reader.locate(name)[0] for name in items}
    problems += [f"checkpoint tensor {key!r} has no row in the {settings.family.model_type} weight table"
                 for key in reader.stored_keys() if key not in table_keys]
    for key in table_keys & set(reader.stored_keys()):
        layers = reader.stacked_layers(key)
        if key.startswith(("decoder.layers.", "encoder.layers.")) and layers != settings.num_layers:
            problems.append(f"checkpoint tensor {key!r} stacks {layers} layers, the config has {settings.num_layers}")
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


def hf_tensors(*, reader: McoreTensorReader, settings: ModelSettings, plan) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in its original dtype), one megatron tensor read at a time, in the plan's order."""
    ctx = settings.shape_context()
    for item, outputs in plan:
        tensors = transforms.to_hf(item.kind, reader.get(item.megatron), ctx=ctx)
        for (hf_name, _, dtype), tensor in zip(outputs, tensors):
            yield hf_name, transforms.to_hf_storage(tensor, transposed=item.transposed).to(dtype).contiguous()


def plan_shards(entries: list[HfEntry], *, max_shard_bytes: int) -> list[list[int]]:
    """Indices of `entries` per shard, in order: a new shard starts when the next tensor would pass the limit."""
    shards, current, current_bytes = [], [], 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = _nbytes(shape, dtype)
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    return shards + [current]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def safetensors_header(entries: list[HfEntry]) -> bytes:
    """The safetensors header for tensors stored back to back in this order (8-byte length, JSON padded to 8)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        nbytes = _nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], *, entries, out_dir: Path, max_shard_bytes: int,
                      progress: Callable[[str], None] | None = None) -> int:
    """Write HF-style shards (model-0000i-of-0000n.safetensors + index, or one model.safetensors) from a stream
    of tensors that arrives in the order of `entries` (name, shape, dtype); returns the number of shards."""
    shards = plan_shards(entries, max_shard_bytes=max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    stream = iter(tensors)
    for file_name, indices in zip(files, shards):
        shard_entries = [entries[i] for i in indices]
        with open(out_dir / file_name, "wb") as handle:
            handle.write(safetensors_header(shard_entries))
            for name, shape, dtype in shard_entries:
                got_name, tensor = next(stream)
                if (got_name, tuple(tensor.shape), tensor.dtype) != (name, shape, dtype):
                    raise AdapterError(f"export produced {got_name} {tuple(tensor.shape)} {tensor.dtype}, "
                                       f"planned {name} {shape} {dtype}")
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy())
        if progress:
            progress(f"wrote {file_name}")
    if len(shards) > 1:
        weight_map = {entries[i][0]: file_name for file_name, indices in zip(files, shards) for i in indices}
        total = sum(_nbytes(shape, dtype) for _, shape, dtype in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


@torch.no_grad()
def convert_mcore_to_hf(*, mcore_dir: Path, out_dir: Path, overwrite: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        progress: Callable[[str], None] | None = None) -> dict:
    """Export a dsmt megatron checkpoint (any layout it was saved from) as an HF directory, streamed."""
    from toolkit.models import inspect_checkpoint

    ckpt.refuse_existing(out_dir, overwrite=overwrite)
    info = inspect_checkpoint(mcore_dir)
    if info.kind != "mcore":
        raise ckpt.CheckpointError(f"{mcore_dir} is an HF checkpoint, not a dsmt megatron one; "
                                   "use `dsmt convert hf-to-mcore`")
    reader = McoreTensorReader(Path(mcore_dir) / "model")
    dtypes = {name: getattr(torch, dtype) for name, dtype in info.hf_tensor_dtypes().items()}
    plan = export_plan(reader=reader, settings=info.settings, dtypes=dtypes)
    entries = [entry for _, outputs in plan for entry in outputs]
    with ckpt.atomic_output_dir(out_dir, overwrite=overwrite) as temp_dir:
        tensors = hf_tensors(reader=reader, settings=info.settings, plan=plan)
        num_shards = write_safetensors(tensors, entries=entries, out_dir=temp_dir, max_shard_bytes=max_shard_bytes,
                                       progress=progress)
        ckpt.copy_side_files(info.hf_dir, temp_dir)
    return {"shards": num_shards, "dtype": ckpt.dtype_name(info.params_dtype)}
