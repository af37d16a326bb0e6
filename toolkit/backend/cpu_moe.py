"""What megatron-core's mixture-of-experts layers need on the CPU (gloo) beyond `toolkit/backend/cpu.py`.

Installed by `cpu.install()` together with the other redirections, so only where CUDA is absent. Each stand-in
names the megatron-core 0.16.1 site it serves (docs/moe-notes.md, 2.2 / 3.2 / 8, showed each failing without it):

  torch.cuda.Stream         the alltoall dispatcher creates a class-level D2H stream (token_dispatcher.py:445) and
                            records an event on it whose `synchronize()` it calls; on the CPU there is nothing to
                            wait for. A class, because transformers evaluates `torch.cuda.Stream | None`.
  Tensor.new_empty          `_AllToAll` allocates its output with `device=torch.cuda.current_device()`
                            (tensor_parallel/mappings.py:439), also inside autograd's backward.
  split sizes as numpy      the dispatcher turns its split-size tensors into numpy only `if tensor.is_cuda`
                            (moe_utils.maybe_move_tensor_to_cpu); gloo's `all_to_all_single` takes a sequence of
                            ints, not a tensor.
  uneven all_gather         with tp > 1 the dispatcher gathers each TP rank's routed tokens, of different counts
                            (mappings.py:150, a list `all_gather`); gloo requires equal sizes, so the tensors are
                            padded to the largest, gathered and cut back. NCCL gathers uneven lists itself.
The megatron-core bug that hits every machine without Transformer Engine is fixed in `toolkit/backend/megatron_fixes.py`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


class _CpuEvent:
    """A CUDA event stand-in: everything on the CPU has already happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, *args, **kwargs) -> None:
        return None

    def query(self) -> bool:
        return True


def stream_class(null_stream: type) -> type:
    """A `torch.cuda.Stream` stand-in class: the backend's null stream whose `record_event()` gives an event."""

    class CpuStream(null_stream):
        def __init__(self, *args, **kwargs):
            pass

        def record_event(self, *args, **kwargs) -> _CpuEvent:
            return _CpuEvent()

    return CpuStream


def wrap_split_sizes(original):
    """megatron's `maybe_move_tensor_to_cpu`, with CPU tensors turned into numpy when asked (as CUDA ones are)."""

    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def wrap_uneven_all_gather(original):
    """`dist.all_gather(list, tensor)` accepting tensors whose first dimension differs between ranks (gloo
    refuses them): pad to the largest first dimension, gather, copy each rank's rows back into the list."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
        if len(shapes) == 1 or tensor.dim() == 0:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensor_list]
        own = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        own[: tensor.shape[0]] = tensor
        work = original(padded, own, group=group)
        for target, gathered in zip(tensor_list, padded):
            target.copy_(gathered[: target.shape[0]])
        return _DoneWork() if async_op else work

    return all_gather


class _DoneWork:
    """The handle of a collective that already finished (the padded gather above runs synchronously)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def install(*, patch, null_stream: type, wrap_factory) -> None:
    """Put the stand-ins in place through the backend's `patch` (so `cpu.uninstall()` undoes them);
    `wrap_factory` is the backend's redirection of a factory's `device=` (cpu._wrap_factory)."""
    from megatron.core.transformer.moe import token_dispatcher

    patch(torch.cuda, "Stream", stream_class(null_stream))
    patch(torch.Tensor, "new_empty", wrap_factory(torch.Tensor.new_empty, "Tensor.new_empty"))
    patch(token_dispatcher, "maybe_move_tensor_to_cpu", wrap_split_sizes(token_dispatcher.maybe_move_tensor_to_cpu))
    patch(dist, "all_gather", wrap_uneven_all_gather(dist.all_gather))
