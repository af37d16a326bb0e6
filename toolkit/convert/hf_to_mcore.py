"""HF checkpoint -> dsmt megatron checkpoint (layout-free dist_checkpointing), streamed chunk by chunk.

megatron-core says what to write: the model is built on the meta device (no memory) at TP=1 / PP=1 with the
local layer spec, and its `sharded_state_dict()` gives every stored chunk (key, global shape, offsets, dtype) and
`_extra_state` object, the same as `dist_checkpointing.save` of a real model would store. The family's weight
table says where each chunk's rows come from in the HF tensors (`rows.py`), and `dcp_writer.py` reads those rows
from the safetensors files straight into the chunk only when torch's checkpoint writer writes it. Peak memory is
one chunk per writer thread, whatever the model's size.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from toolkit import backend as backends
from toolkit.adapters import transforms
from toolkit.adapters.family import LoadItem
from toolkit.adapters.hf_config import DEFAULT_VOCAB_PAD_MULTIPLE, ModelSettings
from toolkit.adapters.hf_source import SafetensorsSource
from toolkit.adapters.load import passthrough_names, plan_load, read_hf
from toolkit.convert import checkpoint as ckpt
from toolkit.convert.dcp_writer import ObjectChunk, TensorChunk, write_torch_dist
from toolkit.convert.progress import ConversionSummary, byte_progress, peak_rss_bytes
from toolkit.convert.mcore_reader import PER_LAYER_KEY, STACKED_EXPERTS
from toolkit.convert.passthrough import passthrough_bytes, write_passthrough
from toolkit.convert.raw_io import SafetensorsRows
from toolkit.convert.rows import megatron_blocks, within
from toolkit.launch.local import single_process_group
from toolkit.parallel.groups import Layout

_STACK = re.compile(r"^(decoder|encoder)\.layers\.(.+)$")


def meta_sharded_state(*, settings: ModelSettings, params_dtype: torch.dtype):
    """(sharded tensors, sharded objects, common state dict) of the layout-free model, built on the meta device.
    Needs megatron's model-parallel state initialised at TP=1 / PP=1."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    from toolkit.adapters.build import model_chunks, transformer_config

    with torch.device("meta"):
        config = transformer_config(settings=settings, layout=Layout(), params_dtype=params_dtype)
        # On a GPU node megatron would pass device=cuda explicitly (use_cpu_initialization=False), which the meta
        # context does not override: the whole model would land on the GPU. Without a device it lands on meta.
        config.use_cpu_initialization = True
        (model,) = model_chunks(config=config, settings=settings, layout=Layout(), attention="local",
                                parallel_output=True)
    sharded, common = save_preprocess(model.sharded_state_dict(), validate_access_integrity=False)
    values = [v for v in nested_values(sharded) if is_main_replica(v.replica_id)]
    return ([v for v in values if isinstance(v, ShardedTensor)], [v for v in values if isinstance(v, ShardedObject)],
            common)


def canonical_name(tensor) -> str:
    """dsmt's table name of a megatron ShardedTensor: its key with the layer index of a stacked key put back, and
    for an expert's (stacked over layers and experts) the global expert index too."""
    per_layer = PER_LAYER_KEY.match(tensor.key)
    if per_layer:  # one layer's key (dense and MoE layers mixed): only an expert's is stacked, over the experts
        rest = tensor.key[per_layer.end():]
        if tensor.prepend_axis_num == 1 and rest.startswith(STACKED_EXPERTS):
            return f"{per_layer.group(0)}mlp.experts.{tensor.global_offset[0]}.{rest.removeprefix(STACKED_EXPERTS)}"
        return tensor.key
    match = _STACK.match(tensor.key)
    if match and tensor.prepend_axis_num == 2 and match.group(2).startswith(STACKED_EXPERTS):
        layer, expert = tensor.global_offset[:2]
        return f"{match.group(1)}.layers.{layer}.mlp.experts.{expert}.{match.group(2).removeprefix(STACKED_EXPERTS)}"
    if match and tensor.prepend_axis_num == 1:
        return f"{match.group(1)}.layers.{tensor.global_offset[0]}.{match.group(2)}"
    return tensor.key


def _chunk_rows(tensor) -> tuple[int, int]:
    """(first row, rows) of the canonical tensor that this ShardedTensor holds; whole rows only (TP=1)."""
    lead = tensor.prepend_axis_num
    rest_offsets, rest_global = tensor.global_offset[lead + 1:], tensor.global_shape[lead + 1:]
    if any(rest_offsets) or tuple(tensor.local_shape[1:]) != tuple(rest_global):
        raise ValueError(f"{tensor.key}: chunk at {tensor.global_offset} is not whole rows of {tensor.global_shape}")
    return tensor.global_offset[lead], tensor.local_shape[0]


def chunk_maker(*, item: LoadItem, start: int, shape: tuple[int, ...], stored_shape: tuple[int, ...],
                dtype: torch.dtype, settings: ModelSettings, source: SafetensorsSource, rows: SafetensorsRows):
    """A function making rows [start, start + shape[0]) of the table row's layout-free tensor, in `dtype`, shaped
    as the chunk is stored (`stored_shape`: with megatron's leading layer axis for a stacked key)."""
    ctx = settings.shape_context()

    def make() -> torch.Tensor:
        if item.transposed or item.expert_slice is not None:  # Conv1D [in, out], or an expert's slice of a
            # stacked tensor (GPT-OSS): read whole (the slice alone), transform, take the rows
            hf = [transforms.from_hf_storage(read_hf(source, n, item=item), transposed=item.transposed)
                  for n in item.hf]
            full = transforms.to_megatron(item.kind, hf, ctx=ctx)
            return full[start:start + shape[0]].to(dtype).contiguous().reshape(stored_shape)
        out = torch.empty(shape, dtype=dtype)
        blocks = megatron_blocks(item.kind, hf_rows=[source.shape(n)[0] for n in item.hf], ctx=ctx)
        for block in within(blocks, start=start, stop=start + shape[0]):
            target = out[block.megatron_start:block.megatron_start + block.num_rows]
            if block.hf_index is None:
                target.zero_()  # vocab padding
            else:
                rows.read_rows(item.hf[block.hf_index], start=block.hf_start, into=target)
        return out.reshape(stored_shape)

    return make


def plan_chunks(*, settings: ModelSettings, source: SafetensorsSource, rows: SafetensorsRows,
                sharded_tensors: list) -> list[TensorChunk]:
    """Every stored chunk with its maker, after checking the whole table against the HF tensors (one error)."""
    full_shapes = {canonical_name(t): tuple(t.global_shape[t.prepend_axis_num:]) for t in sharded_tensors}
    targets = {name: torch.empty(shape, device="meta") for name, shape in full_shapes.items()}
    items = {item.megatron: item for item in plan_load(settings=settings, source=source, targets=targets, tp_size=1)}
    chunks = []
    for tensor in sharded_tensors:
        start, num_rows = _chunk_rows(tensor)
        shape = (num_rows, *tensor.local_shape[1:])
        stored_shape = (*(1,) * tensor.prepend_axis_num, *shape)
        make = chunk_maker(item=items[canonical_name(tensor)], start=start, shape=shape, stored_shape=stored_shape,
                           dtype=tensor.dtype, settings=settings, source=source, rows=rows)
        chunks.append(TensorChunk(key=tensor.key, global_shape=tuple(tensor.global_shape),
                                  offsets=tuple(tensor.global_offset), sizes=stored_shape, dtype=tensor.dtype,
                                  make=make))
    return chunks


def read_hf_checkpoint(*, hf_dir: Path, vocab_pad_multiple: int, dequantize_fp8: bool, dequantize_mxfp4: bool = False):
    """(settings, source, params dtype) of an HF checkpoint; a quantised one is refused by name (read as bf16 with
    `dequantize_fp8` when it is block-scaled FP8), before any model is built."""
    from toolkit.adapters.hf_config import load_hf_config, model_settings
    from toolkit.convert.chunks import stored_dtype

    if ckpt.is_megatron_dir(hf_dir):
        ckpt.read_metadata(hf_dir)  # another tool's megatron checkpoint: refused by name there
        raise ckpt.CheckpointError(f"{hf_dir} is already a dsmt megatron checkpoint; use `dsmt convert mcore-to-hf`")
    hf_config = load_hf_config(hf_dir)
    ckpt.side_files(hf_dir)  # a side file linked outside the checkpoint is refused before minutes of work
    source = SafetensorsSource(hf_dir, dequantize_fp8=dequantize_fp8, dequantize_mxfp4=dequantize_mxfp4)
    settings = model_settings(hf_config, vocab_pad_multiple=vocab_pad_multiple, tensor_names=source.names())
    return settings, source, stored_dtype(source)


def convert_hf_to_mcore(*, hf_dir: Path, out_dir: Path, overwrite: bool = False,
                        vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE, workers: int = 1,
                        show_progress: bool = True, dequantize_fp8: bool = False,
                        dequantize_mxfp4: bool = False) -> ConversionSummary:
    """Convert, streamed; the output appears complete or not at all. `dequantize_fp8`: a block-scaled FP8
    checkpoint (DeepSeek-V3) is read as bf16, and the output is a bf16 checkpoint (no quantization_config)."""
    from megatron.core import parallel_state

    started = time.perf_counter()
    ckpt.refuse_existing(out_dir, overwrite=overwrite)  # before minutes of work
    settings, source, params_dtype = read_hf_checkpoint(hf_dir=hf_dir, vocab_pad_multiple=vocab_pad_multiple,
                                                        dequantize_fp8=dequantize_fp8,
                                                        dequantize_mxfp4=dequantize_mxfp4)
    rows = SafetensorsRows(source)
    backend = backends.current()
    with single_process_group(dist_backend=backend.dist_backend):
        parallel_state.initialize_model_parallel(1, 1)
        backend.seed(0)
        tensors, objects, common = meta_sharded_state(settings=settings, params_dtype=params_dtype)
    chunks = plan_chunks(settings=settings, source=source, rows=rows, sharded_tensors=tensors)
    kept = passthrough_names(patterns=settings.passthrough_hf, names=source.names())
    total_bytes = sum(chunk.nbytes for chunk in chunks) + passthrough_bytes(source, kept)
    try:
        with ckpt.atomic_output_dir(out_dir, overwrite=overwrite, needed_bytes=total_bytes) as temp_dir, \
                byte_progress(total_bytes=total_bytes, description="hf-to-mcore", enabled=show_progress) as advance:
            write_torch_dist(model_dir=temp_dir / "model", tensors=chunks, common=common, workers=workers,
                             objects=[ObjectChunk(obj.unique_key, obj.data) for obj in objects], on_written=advance)
            write_passthrough(source=source, names=kept, mcore_dir=temp_dir, on_written=advance)
            ckpt.copy_side_files(hf_dir, temp_dir / "hf")
            ckpt.drop_quantization_config(temp_dir / "hf")  # the weights are bf16 now (or were never quantised)
            ckpt.write_metadata(temp_dir, model_type=settings.family.model_type,
                                padded_vocab_size=settings.padded_vocab_size, vocab_pad_multiple=vocab_pad_multiple,
                                params_dtype=params_dtype, source=str(Path(hf_dir).resolve()),
                                hf_tensor_dtypes={n: ckpt.dtype_name(source.dtype(n)) for n in source.names()})
    finally:
        rows.close()
    return ConversionSummary(direction="hf-to-mcore", out_dir=Path(out_dir), tensors=len(source.names()),
                             nbytes=total_bytes, files=len(chunks) + len(objects) + (1 if kept else 0),
                             seconds=time.perf_counter() - started, peak_rss_bytes=peak_rss_bytes(),
                             dtype=ckpt.dtype_name(params_dtype),
                             rounded=rounded_patterns(settings=settings, source=source, sharded_tensors=tensors))


def rounded_patterns(*, settings: ModelSettings, source: SafetensorsSource, sharded_tensors: list) -> tuple[str, ...]:
    """The weight table's HF tensors stored in a wider float dtype than the megatron tensor made from them (a float32
    router weight in a bf16 model), as name patterns (`*` for numbers)."""
    items = settings.load_items()
    stored = {canonical_name(t): t.dtype for t in sharded_tensors}
    wide = sorted({hf for name, dtype in stored.items() if name in items for hf in items[name].hf
                   if (hf_dtype := source.dtype(hf)) is not None and hf_dtype.is_floating_point
                   and hf_dtype.itemsize > dtype.itemsize})
    return tuple(dict.fromkeys(re.sub(r"\.\d+(?=\.)", ".*", name) for name in wide))
