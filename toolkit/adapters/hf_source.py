"""Streamed reads of an HF checkpoint's safetensors: headers first (names, shapes, dtypes), then one tensor at a
time, so conversion never holds the HF model and the megatron model together. Header handles stay open (they
touch only the headers); tensor reads use their own short-lived handle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from toolkit.adapters.family import AdapterError

INDEX_NAME = "model.safetensors.index.json"


class SafetensorsSource:
    """Tensor name -> (file, shape, dtype) for a checkpoint directory; `get(name)` reads one tensor."""

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint_dir = Path(checkpoint_dir)
        self._handles: dict[Path, object] = {}
        self._file_of: dict[str, Path] = {}
        for path in self._shard_files():
            handle = self._open(path)
            for name in handle.keys():
                self._file_of[name] = path

    def _shard_files(self) -> list[Path]:
        index = self.checkpoint_dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise AdapterError(f"{index} is not a valid safetensors index ({err})") from err
            files = sorted({self.checkpoint_dir / f for f in weight_map.values()})
            missing = [str(f.name) for f in files if not f.is_file()]
            if missing:
                raise AdapterError(f"{index} lists shard files that are missing: {', '.join(missing)}")
            return files
        files = sorted(self.checkpoint_dir.glob("*.safetensors"))
        if not files:
            legacy = [p.name for p in self.checkpoint_dir.glob("*.bin")]
            hint = (f" It has {', '.join(legacy)}: re-save with model.save_pretrained(dir, safe_serialization=True)."
                    if legacy else "")
            raise AdapterError(f"no *.safetensors weights in {self.checkpoint_dir}.{hint}")
        return files

    def _open(self, path: Path):
        try:
            handle = safe_open(str(path), framework="pt")
            handle.keys()
        except (SafetensorError, OSError, ValueError) as err:
            raise AdapterError(
                f"{path} is not a readable safetensors file ({err}); it may be truncated or corrupt: "
                "re-download or re-save the checkpoint"
            ) from err
        self._handles[path] = handle
        return handle

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES.get(self._handles[self._file_of[name]].get_slice(name).get_dtype(), None)

    def nbytes(self, name: str) -> int:
        shape = self.shape(name)
        numel = 1
        for size in shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype(name)).element_size()

    def get(self, name: str) -> torch.Tensor:
        # A fresh handle per tensor: safetensors memory-maps the file, and the pages a read touches stay resident
        # (and counted in RSS) while a handle is open. Closing it after each tensor keeps reads streamed.
        try:
            with safe_open(str(self._file_of[name]), framework="pt") as handle:
                return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise AdapterError(f"cannot read tensor {name!r} from {self._file_of[name]} ({err}); the file may be corrupt") from err


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
