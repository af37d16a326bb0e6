"""Write a megatron-core torch_dist checkpoint whose tensors are made one at a time, as the writer asks for them.

megatron's own `dist_checkpointing.save` takes a state dict of tensors that already exist (a whole model in
memory). The files it writes are a torch.distributed.checkpoint (`.metadata` + `*.distcp`), `common.pt` (the
non-sharded part of the state dict) and `metadata.json` (the backend). This module writes the same files with a
SavePlanner whose `resolve_data` builds each chunk only when torch's FileSystemWriter writes it; with one file
per chunk (`single_file_per_rank=False`) the writer drops each tensor once written, so memory holds one chunk per
writer thread. The chunks are laid out exactly as megatron lays them out (same keys, global shapes, offsets,
`_extra_state` objects), so `dist_checkpointing.load` reads the result at any TP x PP.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class TensorChunk:
    """One stored chunk of a megatron tensor: `make()` returns it (shape `sizes`, dtype `dtype`)."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.sizes).numel() * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ObjectChunk:
    """A megatron ShardedObject (e.g. a layer's `_extra_state`), stored under its unique key as megatron does."""

    unique_key: str
    value: object


def _write_items(tensors: list[TensorChunk], objects: list[ObjectChunk]) -> list:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = [WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO) for obj in objects]
    for chunk in tensors:
        items.append(WriteItem(
            index=MetadataIndex(chunk.key, torch.Size(chunk.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)),
                                        properties=TensorProperties(dtype=chunk.dtype),
                                        size=torch.Size(chunk.global_shape))))
    return items


def _lazy_planner(tensors: list[TensorChunk], objects: list[ObjectChunk], on_written: Callable[[int], None]):
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    by_index = {(c.key, tuple(c.offsets)): c for c in tensors}
    by_key = {obj.unique_key: obj for obj in objects}

    class LazyPlanner(SavePlanner):
        first_error: BaseException | None = None  # torch wraps it in a CheckpointException; re-raised as it was

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            pass  # the plan comes from the chunks, not from a state dict

        def create_local_plan(self) -> SavePlan:
            return SavePlan(_write_items(tensors, objects))

        def create_global_plan(self, all_plans):
            return create_default_global_save_plan(all_plans)

        def finish_plan(self, new_plan):
            return new_plan

        def resolve_data(self, write_item):
            if write_item.tensor_data is None:
                # megatron stores a ShardedObject as torch.save([data, ...]) of the objects with that key
                buffer = io.BytesIO()
                torch.save([by_key[write_item.index.fqn].value], buffer)
                return buffer
            chunk = by_index[(write_item.index.fqn, tuple(write_item.index.offset))]
            try:
                tensor = chunk.make()
            except BaseException as err:
                self.first_error = self.first_error or err
                raise
            if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
                raise ValueError(f"{chunk.key} at {chunk.offsets}: made {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"planned {chunk.sizes} {chunk.dtype}")
            on_written(chunk.nbytes)
            return tensor

    return LazyPlanner()


def write_torch_dist(*, model_dir: Path, tensors: list[TensorChunk], objects: list[ObjectChunk], common: dict,
                     workers: int = 1, on_written: Callable[[int], None] = lambda nbytes: None) -> None:
    """Write the chunks as megatron's torch_dist checkpoint in `model_dir` (created), `workers` writer threads."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save(common, model_dir / "common.pt")  # megatron's common strategy: the non-sharded part
    writer = dcp.FileSystemWriter(str(model_dir), single_file_per_rank=False, thread_count=workers,
                                  sync_files=False)
    planner = _lazy_planner(tensors, objects, on_written)
    try:
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except dcp.api.CheckpointException:
        if planner.first_error is not None:  # e.g. a truncated safetensors file: dsmt's own error, not torch's
            raise planner.first_error from None
        raise
    save_config(CheckpointingConfig("torch_dist", 1), str(model_dir))  # last: marks the checkpoint complete
