"""Host batches onto the rank's GPU without stalling it: pinned memory, a non-blocking copy on a side stream.

A pageable host tensor's `.to("cuda")` is synchronous: the host waits for the copy, and with it for every kernel
already queued before it on the same stream, so the next step's launches start only once the GPU is idle. Here:

  1. each CPU tensor is pinned (page-locked; a tensor already pinned, as a loader with `pin_memory=True` gives, is
     used as it is), which lets the DMA engine read it while the host goes on;
  2. the copies are queued on a side stream (one per process), so they run beside the compute stream's kernels
     instead of behind them;
  3. the compute stream waits for the side stream (an event on the GPU, not a host wait) before it uses the
     copies, and each copy is recorded as used by the compute stream, so that the caching allocator does not hand
     its memory (allocated on the side stream) to another tensor while the compute stream may still read it.

The pinned sources stay valid until their copy has run: torch's caching host allocator records the copy's stream
and reuses a pinned block only after it (CachingHostAllocator's record_event). Tensors already on the device are
left as they are; non-tensor values pass through.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _side_stream(device: torch.device):
    return torch.cuda.Stream(device=device)


def copy_to_cuda(batches: list[dict], *, device: torch.device) -> list[dict]:
    """`batches` (dicts of tensors and other values) with every CPU tensor on `device`, as the module docstring
    says; the compute stream is ordered after the copies."""
    compute = torch.cuda.current_stream(device)
    side = _side_stream(device)
    copied: list[torch.Tensor] = []
    with torch.cuda.stream(side):
        moved = [{key: _copy(value, device=device, copied=copied) for key, value in batch.items()}
                 for batch in batches]
    compute.wait_stream(side)
    for tensor in copied:
        tensor.record_stream(compute)
    return moved


def _copy(value, *, device: torch.device, copied: list):
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    # contiguous first: a strided tensor's non-blocking copy goes through a pageable temporary
    value = value.contiguous()
    pinned = value if value.is_pinned() else value.pin_memory()
    copied.append(_to_device(pinned, device, non_blocking=True))
    return copied[-1]


def _to_device(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    return tensor.to(device, non_blocking=non_blocking)


def copy_on_host(batches: list[dict]) -> list[dict]:
    """The CPU backend's copy: the batches are already where the model is (new dicts; the tensors shared)."""
    return [dict(batch) for batch in batches]
