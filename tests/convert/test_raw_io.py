"""Reading tensor bytes in place: torch.save blobs inside a larger file, safetensors rows, truncated files."""

import os

import pytest
import torch
from safetensors.torch import save_file

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_source import SafetensorsSource
from toolkit.convert.raw_io import SafetensorsRows, pread_into, torch_save_data


def blob_file(path, value, *, prefix=b"x" * 37):
    """`value` torch.saved after some unrelated bytes, as torch.distributed.checkpoint packs items into a file."""
    with open(path, "wb") as handle:
        handle.write(prefix)
        torch.save(value, handle)
        return len(prefix), handle.tell() - len(prefix)


@pytest.mark.parametrize("tensor", [torch.randn(3, 5).to(torch.bfloat16), torch.randn(7), torch.randn(1, 4, 6),
                                    torch.arange(12, dtype=torch.int64).reshape(3, 4)])
def test_tensor_bytes_are_found_inside_a_torch_save_blob(tensor, tmp_path):
    offset, length = blob_file(tmp_path / "blob", tensor)
    fd = os.open(tmp_path / "blob", os.O_RDONLY)
    try:
        data = torch_save_data(fd, offset=offset, length=length, shape=tuple(tensor.shape), dtype=tensor.dtype)
        assert data is not None
        into = torch.empty_like(tensor)
        pread_into(fd, into, offset=data, path=tmp_path / "blob")
        assert torch.equal(into, tensor)
    finally:
        os.close(fd)


@pytest.mark.parametrize("value,shape", [(torch.randn(4, 6).t(), (6, 4)),  # transposed: bytes not in row order
                                         (torch.randn(10)[2:8], (6,)),  # a view into a larger storage
                                         ({"not": "a tensor"}, (1,)),
                                         (torch.randn(3, 5), (5, 3))])  # not the shape the metadata promises
def test_blobs_that_cannot_be_read_in_place_are_refused(value, shape, tmp_path):
    offset, length = blob_file(tmp_path / "blob", value)
    fd = os.open(tmp_path / "blob", os.O_RDONLY)
    try:
        assert torch_save_data(fd, offset=offset, length=length, shape=shape, dtype=torch.float32) is None
    finally:
        os.close(fd)


def test_safetensors_rows_with_a_cast_and_a_truncated_file(tmp_path):
    weights = {"a": torch.randn(6, 4).to(torch.bfloat16), "b": torch.randn(5)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    rows = SafetensorsRows(SafetensorsSource(tmp_path))
    into = torch.empty(3, 4, dtype=torch.float32)  # rows 2..4 of a bf16 tensor, read into fp32
    rows.read_rows("a", start=2, into=into)
    assert torch.equal(into, weights["a"][2:5].float())
    bias = torch.empty(2)
    rows.read_rows("b", start=3, into=bias)
    assert torch.equal(bias, weights["b"][3:])
    rows.close()


def test_a_read_past_the_end_of_a_file_names_the_truncation(tmp_path):
    (tmp_path / "short").write_bytes(b"\0" * 10)
    fd = os.open(tmp_path / "short", os.O_RDONLY)
    try:
        with pytest.raises(AdapterError, match="truncated"):
            pread_into(fd, torch.empty(4), offset=2, path=tmp_path / "short")  # 16 bytes from byte 2 of 10
    finally:
        os.close(fd)
