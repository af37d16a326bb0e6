"""HF tensors a checkpoint as published carries but the model does not load (DeepSeek-V3's multi-token-prediction
layers, a multimodal checkpoint's vision tower and projector: toolkit/adapters/multimodal.py; named by
`ModelSettings.passthrough_hf`), kept bit-exact through conversion, training and export:

    dsmt convert hf-to-mcore   copies them, each in its own dtype (dequantised with --dequantize-fp8), into
                               <megatron dir>/hf_passthrough.safetensors
    dsmt convert mcore-to-hf   writes that file's tensors back among the exported shards (and into the index)
    dsmt train                 names them once at start as not trained; its final-mcore (and so final-hf) gets
                               them unchanged from model.path (an HF directory or a dsmt megatron checkpoint)

Streamed like every conversion: one tensor in memory at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from toolkit.adapters.hf_source import _SAFETENSORS_DTYPES, SafetensorsSource
from toolkit.adapters.load import passthrough_names
from toolkit.convert.raw_io import HfEntry, tensor_nbytes, write_tensor_files

PASSTHROUGH_FILE = "hf_passthrough.safetensors"


class TensorFile:
    """The tensors of one safetensors file (a megatron checkpoint's passthrough file): names, shapes, dtypes from the
    header; `get(name)` reads one tensor with a short-lived handle."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with safe_open(str(self.path), framework="pt") as handle:
            self._entries = {name: (tuple(handle.get_slice(name).get_shape()),
                                    _SAFETENSORS_DTYPES[handle.get_slice(name).get_dtype()])
                             for name in handle.keys()}

    def names(self) -> list[str]:
        return sorted(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][1]

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(name)


def entries_of(source, names: list[str]) -> list[HfEntry]:
    """(name, shape, dtype) of each tensor as `source.get` returns it."""
    return [(name, tuple(source.shape(name)), source.dtype(name)) for name in names]


def passthrough_bytes(source, names: list[str]) -> int:
    return sum(tensor_nbytes(shape, dtype) for _, shape, dtype in entries_of(source, names))


def write_passthrough(*, source, names: list[str], mcore_dir: Path, on_written=lambda nbytes: None) -> int:
    """Copy tensors `names` of `source` (`SafetensorsSource` or `TensorFile`) into `mcore_dir`'s passthrough file,
    tensor by tensor; written under a temporary name and renamed, so the file is whole or absent. Returns the
    number of tensors (0: no file written)."""
    if not names:
        return 0
    entries = entries_of(source, names)
    target = Path(mcore_dir) / PASSTHROUGH_FILE
    temp = target.with_name(f".{PASSTHROUGH_FILE}.partial-{os.getpid()}")
    try:
        write_tensor_files([lambda name=name: source.get(name) for name in names], entries=entries,
                           files=[(temp, list(range(len(entries))))], on_written=on_written)
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return len(names)


def stored_passthrough(mcore_dir: Path) -> TensorFile | None:
    """The passthrough tensors of a dsmt megatron checkpoint; None when it has none."""
    path = Path(mcore_dir) / PASSTHROUGH_FILE
    return TensorFile(path) if path.is_file() else None


def source_passthrough(*, kind: str, hf_dir: Path, patterns: tuple[str, ...]):
    """(tensor source, names) of the passthrough tensors of the checkpoint a run started from: `kind` and `hf_dir` as
    in `toolkit.convert.chunks.CheckpointInfo` ("hf": the HF directory; "mcore": `hf_dir` is the megatron
    checkpoint's `hf/`, its passthrough file beside it; "init": no weights, nothing to keep)."""
    if not patterns or kind == "init":
        return None, []
    if kind == "mcore":
        stored = stored_passthrough(Path(hf_dir).parent)
        return (stored, stored.names()) if stored is not None else (None, [])
    source = SafetensorsSource(hf_dir)
    return source, passthrough_names(patterns=patterns, names=source.names())


def keep_source_passthrough(*, kind: str, hf_dir: Path, patterns: tuple[str, ...], mcore_dir: Path) -> int:
    """Training's export: the starting checkpoint's passthrough tensors, unchanged, into the trained megatron
    checkpoint `mcore_dir` (whose export to HF then carries them). Returns the number of tensors copied."""
    source, names = source_passthrough(kind=kind, hf_dir=hf_dir, patterns=patterns)
    return write_passthrough(source=source, names=names, mcore_dir=mcore_dir)


def passthrough_notice(*, kind: str, hf_dir: Path, patterns: tuple[str, ...]) -> str | None:
    """The line training prints at start when the model keeps tensors it does not train; None when it keeps none."""
    _, names = source_passthrough(kind=kind, hf_dir=hf_dir, patterns=patterns)
    if not names:
        return None
    return (f"dsmt train: {len(names)} tensor(s) of {', '.join(patterns)} are kept as published but not trained "
            "(dsmt's model does not load them: multi-token-prediction layers, a multimodal model's vision tower and "
            "projector); final-mcore and final-hf carry them unchanged")
