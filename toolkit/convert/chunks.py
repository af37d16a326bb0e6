"""The adapters' public entry point: this rank's megatron-core GPTModel chunks with a checkpoint's weights loaded.

Inside a torch.distributed job whose megatron parallel state is initialised (`toolkit.parallel.groups`):

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
from toolkit.parallel.groups import Layout


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
    if ckpt.is_megatron_dir(path):
        metadata = ckpt.read_metadata(path)
        hf_config = load_hf_config(path / "hf")
        multiple = metadata["vocab_pad_multiple"]
        # the source's tensor names (recorded at conversion): a multimodal checkpoint's naming depends on them
        settings = model_settings(hf_config, vocab_pad_multiple=multiple, tensor_names=list(metadata["hf_tensor_dtypes"]))
        return CheckpointInfo("mcore", path / "hf", settings, hf_config, getattr(torch, metadata["params_dtype"]),
                              multiple, metadata)
    hf_config = load_hf_config(path)
    settings = model_settings(hf_config, vocab_pad_multiple=vocab_pad_multiple)  # the config's problems first
    source = SafetensorsSource(path)
    if settings.family.multimodal_settings is not None:  # its naming and tying depend on the tensor names
        settings = model_settings(hf_config, vocab_pad_multiple=vocab_pad_multiple, tensor_names=source.names())
    return CheckpointInfo("hf", path, settings, hf_config, stored_dtype(source), vocab_pad_multiple)


def stored_dtype(source: SafetensorsSource) -> torch.dtype:
    """The floating dtype most of the checkpoint's bytes are stored in."""
    bytes_by_dtype: dict[torch.dtype, int] = {}
    for name in source.names():
        dtype = source.dtype(name)
        if dtype is not None and dtype.is_floating_point:
            bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + source.nbytes(name)
    return max(bytes_by_dtype, key=bytes_by_dtype.get) if bytes_by_dtype else torch.float32


def check_layout(*, hf_config, layout: Layout, vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE) -> None:
    """The model-side layout rules (toolkit/parallel/rules.py) on the checkpoint's facts, read as `dsmt check` reads
    them (toolkit/adapters/model_shape.py); raises LayoutError listing every one broken."""
    from toolkit.adapters.model_shape import model_facts
    from toolkit.parallel.rules import require_valid_layout

    require_valid_layout(layout=layout, model=model_facts(hf_config, vocab_pad_multiple=vocab_pad_multiple))


def load_model_chunks(*, checkpoint: Path, layout: Layout, params_dtype: torch.dtype | None = None,
                      parallel_output: bool = True, show_progress: bool = False, recompute: str = "none",
                      attention: str | None = None, zero3_config: dict | None = None, fusions: str = "auto"):
    """(chunks, info): this rank's model chunks with the checkpoint's weights, and what the checkpoint is.

    With `zero3_config` (the run's ZeRO-3 DeepSpeed config) the chunks are built partitioned over megatron's
    data-parallel group (`deepspeed.zero.Init`) and loaded one parameter at a time: no rank holds more than its
    share plus one module's parameters (`toolkit/adapters/zero3.py`). HF checkpoints only: a megatron checkpoint is
    loaded by dist_checkpointing into whole tensors."""
    from megatron.core import parallel_state

    from toolkit.adapters.zero3 import load_partitioned, partitioned_build

    info = inspect_checkpoint(checkpoint)
    check_layout(hf_config=info.hf_config, layout=layout, vocab_pad_multiple=info.vocab_pad_multiple)
    if zero3_config is not None and info.kind != "hf":
        raise ckpt.CheckpointError(f"{checkpoint} is a dsmt megatron checkpoint: a ZeRO-3 partitioned build loads HF "
                                   "checkpoints only; export it first (`dsmt convert mcore-to-hf`) or train at ZeRO <= 2")
    with partitioned_build(zero3_config):
        chunks = build_model_chunks(settings=info.settings, layout=layout, params_dtype=params_dtype or info.params_dtype,
                                    parallel_output=parallel_output, recompute=recompute, attention=attention,
                                    fusions=fusions)
    if info.kind == "hf":
        load_hf_weights(chunks=chunks, settings=info.settings, source=SafetensorsSource(info.hf_dir),
                        tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=layout.tp,
                        show_progress=show_progress, write=load_partitioned if zero3_config is not None else None)
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

    from toolkit.convert.threaded_save import threaded_save_strategy

    Path(model_dir).mkdir(parents=True, exist_ok=True)
    # threads, not megatron's forked writers and spawned Manager (toolkit/convert/threaded_save.py)
    dist_checkpointing.save(sharded_state_dict(chunks), str(model_dir), sharded_strategy=threaded_save_strategy())


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


def init_model_chunks(*, hf_dir: Path, layout: Layout, params_dtype: torch.dtype, init_method_std: float, seed: int,
                      vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE, recompute: str = "none",
                      attention: str | None = None, zero3_config: dict | None = None, fusions: str = "auto"):
    """(chunks, info) for pretraining: this rank's chunks initialised by megatron-core itself (normal(0, std),
    output projections std / sqrt(2 * num_layers), norms 1), no weights read. `hf_dir` holds only config.json (and
    tokenizer files); `info` lets the export write final-mcore / final-hf as for a loaded checkpoint.

    Seeded with seed + 100 * pipeline rank, as Megatron-LM does, so the stages' layers differ (the same seed would
    give layer i and layer i + num_layers / pp equal weights); the data-parallel replicas stay identical.
    With `zero3_config` each module is partitioned as soon as megatron has initialised it (`deepspeed.zero.Init`)."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.adapters.zero3 import partitioned_build

    hf_config = load_hf_config(hf_dir)
    settings = model_settings(hf_config, vocab_pad_multiple=vocab_pad_multiple)
    check_layout(hf_config=hf_config, layout=layout, vocab_pad_multiple=vocab_pad_multiple)
    backend = backends.current()
    backend.seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    with partitioned_build(zero3_config):
        chunks = build_model_chunks(settings=settings, layout=layout, params_dtype=params_dtype, init_weights=True,
                                    init_method_std=init_method_std, recompute=recompute, attention=attention,
                                    fusions=fusions)
    backend.seed(seed)  # back to the state every rank of the load path continues from
    hf_names = [name for item in settings.load_items().values() for name in item.hf]
    metadata = {"source": str(Path(hf_dir).resolve()),  # config and tokenizer only: there are no source weights
                "hf_tensor_dtypes": {name: ckpt.dtype_name(params_dtype) for name in hf_names}}
    info = CheckpointInfo("init", Path(hf_dir), settings, hf_config, params_dtype, vocab_pad_multiple, metadata)
    return chunks, info
