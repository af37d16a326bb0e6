"""HF checkpoint -> dsmt megatron checkpoint (layout-free dist_checkpointing), in one process.

The model is built once at TP=1/PP=1 in the checkpoint's own dtype and filled tensor by tensor from safetensors,
so peak memory is one model plus the largest tensor, never the HF and megatron models together."""

from __future__ import annotations

from pathlib import Path

from toolkit import backend as backends
from toolkit.adapters.hf_config import DEFAULT_VOCAB_PAD_MULTIPLE
from toolkit.adapters.hf_source import SafetensorsSource
from toolkit.adapters.load import load_hf_weights
from toolkit.convert import checkpoint as ckpt
from toolkit.launch import single_process_group
from toolkit.parallel import Layout


def convert_hf_to_mcore(*, hf_dir: Path, out_dir: Path, overwrite: bool = False,
                        vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE, show_progress: bool = True) -> dict:
    from megatron.core import parallel_state

    from toolkit.adapters.build import build_model_chunks
    from toolkit.models import inspect_checkpoint, save_mcore_checkpoint

    ckpt.refuse_existing(out_dir, overwrite=overwrite)  # before minutes of work
    info = inspect_checkpoint(hf_dir, vocab_pad_multiple=vocab_pad_multiple)
    if info.kind != "hf":
        raise ckpt.CheckpointError(f"{hf_dir} is already a dsmt megatron checkpoint; use `dsmt convert mcore-to-hf`")
    source = SafetensorsSource(hf_dir)
    backend = backends.current()
    with single_process_group(dist_backend=backend.dist_backend):
        parallel_state.initialize_model_parallel(1, 1)
        backend.seed(0)
        chunks = build_model_chunks(settings=info.settings, layout=Layout(), params_dtype=info.params_dtype)
        bytes_read = load_hf_weights(chunks=chunks, settings=info.settings, source=source, tp_rank=0, tp_size=1,
                                     show_progress=show_progress)
        save_mcore_checkpoint(chunks=chunks, info=info, out_dir=out_dir, params_dtype=info.params_dtype,
                              overwrite=overwrite)
    return {"tensors": len(source.names()), "bytes": bytes_read, "dtype": ckpt.dtype_name(info.params_dtype)}
