"""Rows of the tensors of a megatron torch_dist checkpoint, read straight from its files, one block at a time.

megatron's torch_dist format is torch.distributed.checkpoint underneath: a `.metadata` file lists, per key, the
global shape and the stored chunks (one per layer and TP shard; megatron stacks the layers of a key on a leading
axis, `decoder.layers.mlp.linear_fc1.weight` [num_layers, ...]), and where each chunk's `torch.save` blob lies.
A chunk that spans whole rows (every chunk of a TP=1 checkpoint) is read row range by row range into the caller's
tensor; any other chunk (a column-split TP shard, a blob torch wrote another way) is read whole through
torch.distributed.checkpoint's own reader and the needed part copied. Nothing else is held.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from toolkit.adapters.family import AdapterError
from toolkit.convert.raw_io import OpenFiles, pread_into, torch_save_data

_LAYER_NAME = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.+)$")  # GPTModel's stack, or an encoder's
_EXPERT_NAME = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")  # an MoE layer's expert, by its global index
# megatron's key (after `decoder.layers.`) of every expert of every layer, stacked [layers, experts, ...]
# (SequentialMLP.sharded_state_dict).
STACKED_EXPERTS = "mlp.experts.experts."
# A key of one layer of its own: where dense and MoE layers mix, megatron does not stack layers
# (TransformerBlock.sharded_state_dict, `non_homogeneous_layers`); an expert's key then stacks the experts only.
PER_LAYER_KEY = re.compile(r"^(?:decoder|encoder)\.layers\.\d+\.")


class McoreReader:
    """Canonical megatron name (`decoder.layers.7.mlp.linear_fc1.weight`) -> rows of its layout-free tensor."""

    def __init__(self, model_dir: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.model_dir = Path(model_dir)
        self._reader = FileSystemReader(str(model_dir))
        self._metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self._metadata, True)
        self._stored = {key: md for key, md in self._metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}  # drops the `_extra_state` byte blobs
        self._per_layer_prefixes = {m.group(0) for m in map(PER_LAYER_KEY.match, self._stored) if m}
        self._files = OpenFiles()
        self._data_offsets: dict[tuple, int | None] = {}

    def close(self) -> None:
        self._files.close()

    def stored_keys(self) -> list[str]:
        return list(self._stored)

    def locate(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(stored key, index on its leading stacked axes): () for an unstacked tensor, (layer,) for a layer's,
        (layer, expert) for an expert's (megatron stacks a key's experts on a second axis:
        `decoder.layers.mlp.experts.experts.linear_fc1.weight` [num_layers, num_experts, ...])."""
        match = _LAYER_NAME.match(name)
        if not match:
            return name, ()
        stack, layer, rest = match.group(1), int(match.group(2)), match.group(3)
        expert = _EXPERT_NAME.match(rest)
        if self._per_layer(stack, layer):  # dense and MoE layers mixed: megatron keys each layer on its own
            if expert:
                return f"{stack}.layers.{layer}.{STACKED_EXPERTS}{expert.group(2)}", (int(expert.group(1)),)
            return name, ()
        if expert:
            return f"{stack}.layers.{STACKED_EXPERTS}{expert.group(2)}", (layer, int(expert.group(1)))
        return f"{stack}.layers.{rest}", (layer,)

    def _per_layer(self, stack: str, layer: int) -> bool:
        """Whether the checkpoint keys this layer on its own (`decoder.layers.3.<rest>`, megatron's non-homogeneous
        layers: DeepSeek's dense first layers, Qwen2-MoE's mlp_only_layers) rather than stacked over layers."""
        return f"{stack}.layers.{layer}." in self._per_layer_prefixes

    def has(self, name: str) -> bool:
        key, index = self.locate(name)
        return key in self._stored and all(i < size for i, size in zip(index, self._stored[key].size))

    def shape(self, name: str) -> tuple[int, ...]:
        key, index = self.locate(name)
        return tuple(self._stored[key].size)[len(index):]

    def stacked_sizes(self, key: str, *, axes: int) -> tuple[int, ...]:
        """The sizes of a key's `axes` leading stacked axes (layers; layers and experts)."""
        return tuple(self._stored[key].size)[:axes]

    def dtype(self, name: str) -> torch.dtype:
        return self._stored[self.locate(name)[0]].properties.dtype

    def get(self, name: str) -> torch.Tensor:
        """The whole layout-free tensor."""
        tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_rows(name, start=0, into=tensor)
        return tensor

    def read_rows(self, name: str, *, start: int, into: torch.Tensor) -> None:
        """Rows [start, start + len(into)) of `name` into `into` (cast when its dtype differs from the stored one)."""
        key, index = self.locate(name)
        stored = self._stored[key]
        lead = len(index)  # the stacked axes come first
        stop, covered = start + into.shape[0], 0
        for chunk in stored.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not all(offsets[d] <= index[d] < offsets[d] + sizes[d] for d in range(lead)):
                continue
            lo, hi = max(start, offsets[lead]), min(stop, offsets[lead] + sizes[lead])
            if lo >= hi:
                continue
            target = into[lo - start:hi - start]
            for dim in range(lead + 1, len(sizes)):  # a column-split chunk fills part of each row
                target = target.narrow(dim - lead, offsets[dim], sizes[dim])
            self._read_chunk_rows(key, chunk, index=index, rows=(lo, hi), into=target)
            covered += target.numel()
        if covered != into.numel():
            raise AdapterError(f"{self.model_dir}: the stored chunks of {key!r} cover {covered} of the "
                               f"{into.numel()} values of rows {start}..{stop} of {name}; the checkpoint is incomplete")

    def _read_chunk_rows(self, key: str, chunk, *, index: tuple[int, ...], rows: tuple[int, int],
                         into: torch.Tensor) -> None:
        offsets, sizes, lead = tuple(chunk.offsets), tuple(chunk.sizes), len(index)
        whole_rows = all(offsets[d] == 0 and sizes[d] == self._stored[key].size[d] for d in range(lead + 1, len(sizes)))
        data = self._data_offset(key, chunk) if whole_rows and into.is_contiguous() else None
        if data is None:  # read the chunk whole, then copy the part needed
            region = self._load_chunk(key, chunk)
            for axis, position in enumerate(index):
                region = region[position - offsets[axis]]
            into.copy_(region[rows[0] - offsets[lead]:rows[1] - offsets[lead]])
            return
        dtype = self._stored[key].properties.dtype
        row_bytes = math.prod(sizes[lead + 1:]) * dtype.itemsize
        stacked = 0  # which of the chunk's stacked slices holds the rows (C order over the leading axes)
        for axis, position in enumerate(index):
            stacked = stacked * sizes[axis] + position - offsets[axis]
        first = (stacked * sizes[lead] + rows[0] - offsets[lead]) * row_bytes
        target = into if into.dtype == dtype else torch.empty(into.shape, dtype=dtype)
        path = self.model_dir / self._storage(key, chunk).relative_path
        pread_into(self._files.fd(path), target, offset=data + first, path=path)
        if target is not into:
            into.copy_(target)

    def _storage(self, key: str, chunk):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return self._metadata.storage_data[MetadataIndex(key, chunk.offsets)]

    def _data_offset(self, key: str, chunk) -> int | None:
        """Where the chunk's tensor bytes start in its file, or None when they cannot be read in place."""
        cache_key = (key, tuple(chunk.offsets))
        if cache_key not in self._data_offsets:
            info = self._storage(key, chunk)
            if getattr(info, "transform_descriptors", None):  # compressed or otherwise transformed: torch reads it
                self._data_offsets[cache_key] = None
            else:
                fd = self._files.fd(self.model_dir / info.relative_path)
                self._data_offsets[cache_key] = torch_save_data(
                    fd, offset=info.offset, length=info.length, shape=tuple(chunk.sizes),
                    dtype=self._stored[key].properties.dtype)
        return self._data_offsets[cache_key]

    def _load_chunk(self, key: str, chunk) -> torch.Tensor:
        """One stored chunk, read by torch.distributed.checkpoint's reader."""
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        from torch.futures import Future

        target = torch.empty(tuple(chunk.sizes), dtype=self._stored[key].properties.dtype)
        plan = _Plan(create_read_items_for_chunk_list(key, self._stored[key], [chunk]))
        result = self._reader.read_data(plan, _Into(target))
        if isinstance(result, Future):
            result.wait()
        return target


class _Plan:
    """The part of torch's LoadPlan that `FileSystemReader.read_data` reads."""

    def __init__(self, items):
        self.items = items


class _Into:
    """The part of torch's LoadPlanner that `read_data` calls: every read lands in a slice of one tensor."""

    def __init__(self, target: torch.Tensor):
        self.target = target  # dest_offsets are relative to the requested chunk, which `target` is

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.target
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # `tensor` is the view of `target` that `resolve_tensor` returned, already filled

    def load_bytes(self, read_item, value) -> None:
        raise AdapterError(f"unexpected byte item {read_item.dest_index.fqn!r} while reading tensors")
