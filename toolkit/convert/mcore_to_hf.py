"""dsmt megatron checkpoint -> HF checkpoint directory that `transformers` loads (bit-exact round trip)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from toolkit import backend as backends
from toolkit.adapters import transforms
from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_config import ModelSettings
from toolkit.adapters.load import canonical_tensors, expand_table
from toolkit.convert import checkpoint as ckpt
from toolkit.launch import single_process_group
from toolkit.parallel import Layout

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")


def hf_tensors(*, chunks: list, settings: ModelSettings, dtypes: dict[str, torch.dtype]):
    """Yield (HF name, tensor in its original dtype) for a TP=1 model, after checking the table both ways."""
    targets = canonical_tensors(chunks)
    items = expand_table(settings.family.weight_table(tied_embeddings=settings.tied_embeddings),
                         num_layers=settings.num_layers)
    problems = [f"megatron parameter {n!r} has no row in the weight table" for n in targets if n not in items]
    problems += [f"weight table row {n!r} has no megatron parameter" for n in items if n not in targets]
    if problems:
        raise AdapterError("cannot export:\n  - " + "\n  - ".join(problems))
    ctx = settings.shape_context()
    for name, item in items.items():
        for hf_name, tensor in zip(item.hf, transforms.to_hf(item.kind, targets[name], ctx=ctx)):
            yield hf_name, tensor.detach().to(dtypes.get(hf_name, tensor.dtype)).contiguous()


def write_safetensors(tensors, *, out_dir: Path, max_shard_bytes: int) -> int:
    """Write HF-style shards (model-0000i-of-0000n.safetensors + index, or one model.safetensors)."""
    shards, current, current_bytes = [], {}, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name], current_bytes = tensor, current_bytes + nbytes
    shards.append(current)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=metadata)
        return 1
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata=metadata)
        weight_map.update({name: file_name for name in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


@torch.no_grad()
def convert_mcore_to_hf(*, mcore_dir: Path, out_dir: Path, overwrite: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    from megatron.core import parallel_state

    from toolkit.adapters.build import build_model_chunks
    from toolkit.models import inspect_checkpoint, load_dist_checkpoint

    ckpt.refuse_existing(out_dir, overwrite=overwrite)
    info = inspect_checkpoint(mcore_dir)
    if info.kind != "mcore":
        raise ckpt.CheckpointError(f"{mcore_dir} is an HF checkpoint, not a dsmt megatron one; use `dsmt convert hf-to-mcore`")
    backend = backends.current()
    with single_process_group(dist_backend=backend.dist_backend):
        parallel_state.initialize_model_parallel(1, 1)
        backend.seed(0)
        chunks = build_model_chunks(settings=info.settings, layout=Layout(), params_dtype=info.params_dtype)
        load_dist_checkpoint(chunks=chunks, model_dir=Path(mcore_dir) / "model")
        with ckpt.atomic_output_dir(out_dir, overwrite=overwrite) as temp_dir:
            dtypes = {name: getattr(torch, dtype) for name, dtype in info.hf_tensor_dtypes().items()}
            tensors = hf_tensors(chunks=chunks, settings=info.settings, dtypes=dtypes)
            num_shards = write_safetensors(tensors, out_dir=temp_dir, max_shard_bytes=max_shard_bytes)
            ckpt.copy_side_files(info.hf_dir, temp_dir)
    return {"shards": num_shards, "dtype": ckpt.dtype_name(info.params_dtype)}
