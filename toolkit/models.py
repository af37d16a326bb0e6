"""The adapters' public entry point: this rank's megatron-core GPTModel chunks with a checkpoint's weights loaded.

Inside a torch.distributed job whose megatron parallel state is initialised (`toolkit.parallel`):

    chunks, settings = load_model_chunks(checkpoint=path, layout=layout)

`path` is an HF checkpoint directory (streamed from safetensors one tensor at a time, each rank reading only the
tensors of its own layers and slicing its TP shard from them) or a dsmt megatron checkpoint (`dsmt convert hf-to-mcore`; megatron's dist_checkpointing reshards it to this layout).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from toolkit.adapters.build import build_model_chunks
from toolkit.adapters.hf_config import DEFAULT_VOCAB_PAD_MULTIPLE, ModelSettings, load_hf_config, model_settings
from toolkit.adapters.hf_source import SafetensorsSource
from toolkit.adapters.load import load_hf_weights
from toolkit.convert import checkpoint as ckpt
from toolkit.parallel import Layout


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    kind: str  # "hf" or "mcore"
    hf_dir: Path  # where config.json and tokenizer files are
    settings: ModelSettings
    hf_config: object
    params_dtype: torch.dtype  # dtype the weights are stored in
    vocab_pad_multiple: int  # what settings.padded_vocab_size was rounded to
    metadata: dict | None = None  # dsmt_checkpoint.json of a megatron checkpoint (None for HF)

    def source_checkpoint(self) -> str:
        """The HF checkpoint these weights came from (a megatron checkpoint records it)."""
        return self.metadata["source"] if self.metadata else str(self.hf_dir.resolve())

    def hf_tensor_dtypes(self) -> dict[str, str]:
        """HF tensor name -> dtype name, so an export restores every tensor's original dtype."""
        if self.metadata:
            return self.metadata["hf_tensor_dtypes"]
        source = SafetensorsSource(self.hf_dir)
        return {name: ckpt.dtype_name(source.dtype(name)) for name in source.names()}


def inspect_checkpoint(path: Path, *, vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE) -> CheckpointInfo:
    path = Path(path)
    megatron_markers = (ckpt.METADATA_FILE, "model", "latest_checkpointed_iteration.txt", "metadata.json")
    if any((path / marker).exists() for marker in megatron_markers):
        metadata = ckpt.read_metadata(path)
        hf_config = load_hf_config(path / "hf")
        multiple = metadata["vocab_pad_multiple"]
        settings = model_settings(hf_config, vocab_pad_multiple=multiple)
        return CheckpointInfo("mcore", path / "hf", settings, hf_config, getattr(torch, metadata["params_dtype"]),
                              multiple, metadata)
    hf_config = load_hf_config(path)
    settings = model_settings(hf_config, vocab_pad_multiple=vocab_pad_multiple)
    return CheckpointInfo("hf", path, settings, hf_config, stored_dtype(SafetensorsSource(path)), vocab_pad_multiple)


def stored_dtype(source: SafetensorsSource) -> torch.dtype:
    """The floating dtype most of the checkpoint's bytes are stored in."""
    bytes_by_dtype: dict[torch.dtype, int] = {}
    for name in source.names():
        dtype = source.dtype(name)
        if dtype is not None and dtype.is_floating_point:
            bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + source.nbytes(name)
    return max(bytes_by_dtype, key=bytes_by_dtype.get) if bytes_by_dtype else torch.float32


def check_layout(settings: ModelSettings, layout: Layout) -> None:
    fields = settings.transformer_fields
    layout.check(num_attention_heads=fields["num_attention_heads"], num_query_groups=fields["num_query_groups"],
                 num_layers=settings.num_layers, padded_vocab_size=settings.padded_vocab_size)


def load_model_chunks(*, checkpoint: Path, layout: Layout, params_dtype: torch.dtype | None = None,
                      parallel_output: bool = True, show_progress: bool = False, recompute: str = "none"):
    """(chunks, info): this rank's model chunks with the checkpoint's weights, and what the checkpoint is."""
    from megatron.core import parallel_state

    info = inspect_checkpoint(checkpoint)
    check_layout(info.settings, layout)
    chunks = build_model_chunks(settings=info.settings, layout=layout, params_dtype=params_dtype or info.params_dtype,
                                parallel_output=parallel_output, recompute=recompute)
    if info.kind == "hf":
        load_hf_weights(chunks=chunks, settings=info.settings, source=SafetensorsSource(info.hf_dir),
                        tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=layout.tp_size,
                        show_progress=show_progress)
    else:
        load_dist_checkpoint(chunks=chunks, model_dir=Path(checkpoint) / "model")
    return chunks, info


def sharded_state_dict(chunks: list) -> dict:
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


@torch.no_grad()
def load_dist_checkpoint(*, chunks: list, model_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(sharded_state_dict(chunks), str(model_dir))
    if len(chunks) == 1:
        chunks[0].load_state_dict(state)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"])


def save_dist_checkpoint(*, chunks: list, model_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    Path(model_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state_dict(chunks), str(model_dir))


def save_mcore_checkpoint(*, chunks: list, info: CheckpointInfo, out_dir: Path, params_dtype: torch.dtype,
                          overwrite: bool = False) -> None:
    """Save the chunks of every rank as a dsmt megatron checkpoint (collective: all ranks call it).

    Written into a temporary sibling by all ranks; rank 0 adds the metadata and renames it into place only after
    every rank's shards are on disk, so a crash never leaves a directory that looks complete."""
    import torch.distributed as dist

    out_dir = Path(out_dir)
    rank = dist.get_rank()
    ckpt.refuse_existing(out_dir, overwrite=overwrite)
    temp_dir = out_dir.with_name(f".{out_dir.name}.partial")
    if rank == 0:
        shutil.rmtree(temp_dir, ignore_errors=True)
        temp_dir.mkdir(parents=True)
    dist.barrier()
    save_dist_checkpoint(chunks=chunks, model_dir=temp_dir / "model")
    dist.barrier()
    if rank == 0:
        ckpt.copy_side_files(info.hf_dir, temp_dir / "hf")
        ckpt.write_metadata(temp_dir, model_type=info.settings.family.model_type,
                            padded_vocab_size=info.settings.padded_vocab_size,
                            vocab_pad_multiple=info.vocab_pad_multiple, params_dtype=params_dtype,
                            source=info.source_checkpoint(), hf_tensor_dtypes=info.hf_tensor_dtypes())
        if out_dir.exists():
            shutil.rmtree(out_dir)
        temp_dir.rename(out_dir)
    dist.barrier()

