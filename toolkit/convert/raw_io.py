"""Tensor bytes read and written at known file offsets with `os.preadv` / `os.pwrite`: no memory map (whose
touched pages stay resident and count in RSS) and no intermediate buffer (the bytes land in the tensor).

    SafetensorsRows   rows of HF tensors, located from the safetensors headers
    torch_save_data   where one `torch.save` blob (a torch.distributed.checkpoint item) keeps its tensor's bytes
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
import threading
import zipfile
from pathlib import Path

import torch

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_source import _SAFETENSORS_DTYPES


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, sharing its memory."""
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def pread_into(fd: int, tensor: torch.Tensor, *, offset: int, path: Path) -> None:
    view, done = byte_view(tensor), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise AdapterError(f"{path} ends at byte {offset + done}, before the tensor it promises "
                               f"({len(view)} bytes from {offset}): the file is truncated; re-download or re-save it")
        done += got


def pwrite_from(fd: int, tensor: torch.Tensor, *, offset: int) -> None:
    view, done = byte_view(tensor.contiguous()), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class OpenFiles:
    """One read-only descriptor per file, opened on first use, shared by threads (pread needs no seek)."""

    def __init__(self):
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# ---- safetensors ---------------------------------------------------------------------------------------------


def safetensors_entries(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute offset of its bytes), from the header (8-byte length, then JSON)."""
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise AdapterError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)} "
                               f"{entry['dtype']}; the file is corrupt: re-download or re-save it")
        entries[name] = (dtype, shape, 8 + header_len + begin)
    return entries


class SafetensorsRows:
    """Rows of the tensors of an HF checkpoint (`SafetensorsSource`), read straight into a caller's tensor."""

    def __init__(self, source):
        self._where: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}
        for path in {source.file_of(name) for name in source.names()}:
            for name, (dtype, shape, offset) in safetensors_entries(path).items():
                self._where[name] = (path, dtype, shape, offset)
        self._files = OpenFiles()

    def read_rows(self, name: str, *, start: int, into: torch.Tensor) -> None:
        """Rows [start, start + len(into)) of HF tensor `name` into `into` (cast when the dtypes differ)."""
        path, dtype, shape, offset = self._where[name]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        target = into if into.dtype == dtype else torch.empty(into.shape, dtype=dtype)
        pread_into(self._files.fd(path), target, offset=offset + start * row_bytes, path=path)
        if target is not into:
            into.copy_(target)

    def close(self) -> None:
        self._files.close()


# ---- torch.save blobs (the items of a torch.distributed.checkpoint) --------------------------------------------


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of its own (for `zipfile`)."""

    def __init__(self, fd: int, offset: int, length: int):
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: self._length + pos}[whence]
        return self._pos

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, count, self._offset + self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


class _TensorProbe(pickle.Unpickler):
    """Unpickles a torch.save `data.pkl` into (storage key, storage offset, size, stride) without touching data."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, storage_offset, size, stride, *_: (storage[2], storage_offset, tuple(size),
                                                                      tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch":
            return name  # storage types and dtypes: only named
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        return pid  # ("storage", storage type, key, location, numel)


def torch_save_data(fd: int, *, offset: int, length: int, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
    """Absolute file offset of the tensor bytes in the torch.save blob at [offset, offset + length), when the blob
    holds one contiguous tensor of `shape` and `dtype` stored uncompressed (what torch.distributed.checkpoint
    writes); None otherwise, and the caller loads the blob with torch.load."""
    try:
        archive = zipfile.ZipFile(_Window(fd, offset, length))
        pickle_name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        key, storage_offset, size, stride = _TensorProbe(io.BytesIO(archive.read(pickle_name))).load()
        record = archive.getinfo(f"{pickle_name.removesuffix('data.pkl')}data/{key}")
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, TypeError, ValueError):
        return None
    contiguous = tuple(torch.empty(shape, device="meta").stride())
    if (storage_offset, size, record.compress_type) != (0, tuple(shape), zipfile.ZIP_STORED) \
            or (math.prod(shape) > 1 and stride != contiguous) \
            or record.file_size != math.prod(shape) * dtype.itemsize:
        return None
    local_header = os.pread(fd, 30, offset + record.header_offset)
    signature, *_, name_len, extra_len = struct.unpack("<IHHHHHIIIHH", local_header)
    if signature != 0x04034B50:
        return None
    return offset + record.header_offset + 30 + name_len + extra_len
