"""Files of a checkpoint hashed while they are written: the xxh3-128 digest the manifest records
(toolkit/train/checkpoint/manifest.py) is taken from the bytes on their way to the file, so a save never reads back
what it wrote (at 70B, ~850 GB per checkpoint that every save would otherwise read again).

A rank's share of the optimizer state is a safetensors file: the format every HF tool reads, no pickle, and
`safe_open(...).get_slice` reads a block of a tensor without the rest (what a rank of another layout needs). It is
written here, streamed, because safetensors' own writers take the whole dict at once and hand back no digest; the
layout is safetensors' (an 8-byte little-endian header length, the JSON header padded to 8 bytes, then each
tensor's bytes in header order) and it is read back by safetensors itself."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import xxhash

from toolkit.errors import DsmtError

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


class HashedFile:
    """A binary file opened for writing whose every written byte also goes into an xxh3-128 digest."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close() / the context manager
        self._hash = xxhash.xxh3_128()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._file.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def entry(self) -> dict:
        """The manifest's entry of the file as written: {"size", "xxh3_128"}."""
        return {"size": self.size, "xxh3_128": self._hash.hexdigest()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], *, metadata: dict[str, str] | None = None
                      ) -> dict:
    """Write `tensors` (CPU, contiguous) as a safetensors file, streamed; returns its manifest entry."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES or tensor.device.type != "cpu":
            raise DsmtError(f"{name}: {tensor.dtype} on {tensor.device} cannot go into {path.name} (CPU tensors of "
                            f"{', '.join(map(str, DTYPES))} only: a dsmt bug, report it)")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset,
                                                                                                    offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    with HashedFile(path) as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for tensor in tensors.values():
            if tensor.numel():
                out.write(tensor.contiguous().view(torch.uint8).numpy())
        return out.entry()


def save_hashed(obj, path: Path) -> dict:
    """`torch.save(obj, path)` through a hashed file; returns its manifest entry."""
    with HashedFile(path) as out:
        torch.save(obj, out)
        return out.entry()
