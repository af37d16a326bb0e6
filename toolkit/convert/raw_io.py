"""Tensor bytes read and written at known file offsets with `os.preadv` / `os.pwrite`: no memory map (whose
touched pages stay resident and count in RSS) and no intermediate buffer (the bytes land in the tensor).

    SafetensorsRows      rows of HF tensors, located from the safetensors headers (FP8 ones dequantised)
    write_tensor_files   safetensors files written header first, then tensor by tensor at its offset
    torch_save_data      where one `torch.save` blob (a torch.distributed.checkpoint item) keeps its tensor's bytes
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
from typing import Callable

import torch

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_source import _SAFETENSORS_DTYPES, dequantize_fp8_blocks


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
    """Rows of the tensors of an HF checkpoint (`SafetensorsSource`), read straight into a caller's tensor; an FP8
    weight the source dequantises is read as its FP8 rows and the scale rows of their blocks, dequantised."""

    def __init__(self, source):
        self._source = source
        self._where: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}
        for path in source.files():
            for name, (dtype, shape, offset) in safetensors_entries(path).items():
                self._where[name] = (path, dtype, shape, offset)
        self._files = OpenFiles()

    def read_rows(self, name: str, *, start: int, into: torch.Tensor) -> None:
        """Rows [start, start + len(into)) of HF tensor `name` into `into` (cast when the dtypes differ)."""
        fp8 = self._source.fp8_weight(name)
        if fp8 is not None:
            into.copy_(self._dequantized_rows(name, fp8, start=start, num_rows=len(into)))
            return
        target = into if into.dtype == self._where[name][1] else torch.empty(into.shape, dtype=self._where[name][1])
        self._read_raw(name, start=start, into=target)
        if target is not into:
            into.copy_(target)

    def _read_raw(self, name: str, *, start: int, into: torch.Tensor) -> None:
        path, dtype, shape, offset = self._where[name]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        pread_into(self._files.fd(path), into, offset=offset + start * row_bytes, path=path)

    def _dequantized_rows(self, name: str, fp8, *, start: int, num_rows: int) -> torch.Tensor:
        """Rows [start, start + num_rows) of a block-scaled FP8 weight, dequantised (bf16)."""
        _, dtype, shape, _ = self._where[name]
        block_rows = fp8.block_size[0]
        first_block, end_block = start // block_rows, -(-(start + num_rows) // block_rows)
        weight = torch.empty((num_rows, *shape[1:]), dtype=dtype)
        self._read_raw(name, start=start, into=weight)
        _, scale_dtype, scale_shape, _ = self._where[fp8.scale_name]
        scale = torch.empty((end_block - first_block, *scale_shape[1:]), dtype=scale_dtype)
        self._read_raw(fp8.scale_name, start=first_block, into=scale)
        return dequantize_fp8_blocks(weight, scale, block_size=fp8.block_size,
                                     first_row=start - first_block * block_rows)

    def close(self) -> None:
        self._files.close()


SAFETENSORS_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
HfEntry = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype of one tensor to write


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def safetensors_header(entries: list[HfEntry]) -> bytes:
    """The safetensors header for tensors stored back to back in this order (8-byte length, JSON padded to 8)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        nbytes = tensor_nbytes(shape, dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_tensor_files(makers: list[Callable[[], torch.Tensor]], *, entries: list[HfEntry],
                       files: list[tuple[Path, list[int]]], workers: int = 1,
                       on_written: Callable[[int], None] = lambda n: None,
                       progress: Callable[[str], None] | None = None) -> None:
    """Safetensors files (path, indices of `entries` it holds): every header first, from the planned shapes, then
    each tensor made by its maker and written at its offset by one of `workers` threads (each holds one tensor)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []  # (fd, offset, entry index)
    fds = []
    try:
        for path, indices in files:
            header = safetensors_header([entries[i] for i in indices])
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            os.pwrite(fd, header, 0)
            offset = len(header)
            for i in indices:
                jobs.append((fd, offset, i))
                offset += tensor_nbytes(entries[i][1], entries[i][2])
            os.ftruncate(fd, offset)

        def run(job) -> None:
            fd, offset, i = job
            tensor = makers[i]()
            name, shape, dtype = entries[i]
            if (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
                raise AdapterError(f"made {name} {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}")
            pwrite_from(fd, tensor, offset=offset)
            on_written(tensor.numel() * tensor.element_size())

        with ThreadPoolExecutor(max_workers=workers) as pool:
            for done, _ in enumerate(pool.map(run, jobs), start=1):
                if progress and done % 64 == 0:
                    progress(f"wrote {done} of {len(jobs)} tensors")
    finally:
        for fd in fds:
            os.close(fd)


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
