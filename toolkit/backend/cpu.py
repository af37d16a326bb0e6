"""CPU backend: lets megatron-core's layers, pipeline schedules and dist_checkpointing run on a machine without CUDA.

megatron-core hard-codes CUDA in about ten kinds of places (see shared/CPU_NOTES.md): literal `device="cuda"`
in tensor factories, `torch.cuda.current_device()` for buffers (p2p receive buffers, the tensor-parallel all-gather
inside a custom autograd backward, the global memory buffer, rotary `inv_freq.to(...)`), `torch.cuda.synchronize()`
and `torch.cuda.current_stream()`. Rather than editing megatron, this module redirects CUDA device *requests* to the
CPU at the torch level: the factories megatron calls and `Tensor.to` / `Tensor.cuda`. A `TorchFunctionMode` would be
neater but is switched off inside `torch.autograd.backward`, where megatron's `mappings.py` allocates buffers.

It is installed only when CUDA is absent (`install()` is a no-op otherwise) and records every call site it
redirected, so a test can list exactly what it touched. Nothing else in dsmt knows about CPU.

Collectives need nothing here. Sequence parallelism calls `reduce_scatter_tensor` and `all_gather_into_tensor`
(megatron binds them at import as `dist_reduce_scatter_func` / `dist_all_gather_func`), with and without
`async_op`; gloo implements both since torch 2.3 (reduce-scatter as all-reduce then slice) and dsmt needs torch
>= 2.4. Only their `torch.cuda.current_device()` buffers are redirected, as everywhere else
(tests/backend/test_cpu_sp_collectives.py checks them against all-reduce-then-slice on 2 ranks).
"""

from __future__ import annotations

import collections
import functools
import sys
import threading

import torch
import torch.utils._device

# Factories megatron-core calls with a CUDA device (mcore 0.16.1 / 0.19.2 sites; see shared/mcore-*-cuda-sites.txt).
_FACTORY_NAMES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "empty_like", "zeros_like")

_lock = threading.Lock()
_installed = False
_originals: dict[str, object] = {}
_replacements: dict[str, object] = {}  # what install() put in each place of _originals
# (api, "path:line") -> number of redirected calls; paths are shortened to start at the package name.
redirected_sites: collections.Counter[tuple[str, str]] = collections.Counter()


def is_needed() -> bool:
    return not torch.cuda.is_available()


def is_installed() -> bool:
    return _installed


def install() -> bool:
    """Redirect CUDA requests to the CPU when CUDA is absent. Returns True if the redirection is active."""
    global _installed
    if not is_needed():
        return False
    with _lock:
        if _installed:
            return True
        # torch caches the list of device-aware constructors on first use; building it after our wrappers are in
        # place would register the wrappers instead of the real factories and silently break HF rotary buffers.
        torch.utils._device._device_constructors()
        for name in _FACTORY_NAMES:
            _patch(torch, name, _wrap_factory(getattr(torch, name), f"torch.{name}"))
        _patch(torch.Tensor, "to", _wrap_to(torch.Tensor.to))
        _patch(torch.Tensor, "cuda", _tensor_cuda)
        _patch(torch.cuda, "current_device", _current_device)
        _patch(torch.cuda, "synchronize", _noop("torch.cuda.synchronize"))
        _patch(torch.cuda, "current_stream", _current_stream)
        _patch_megatron_rng()
        _patch_moe()
        _patch_mla()
        _eager_jit_fusers()
        _installed = True
    return True


def uninstall() -> None:
    """Undo `install()` (used by tests)."""
    global _installed
    with _lock:
        for key, original in _originals.items():
            owner_name, attr = key.split(":")
            setattr(_OWNERS[owner_name], attr, original)
        _originals.clear()
        _replacements.clear()
        _installed = False


_OWNERS: dict[str, object] = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.cuda": torch.cuda}


def _eager_jit_fusers() -> None:
    """megatron wraps small elementwise functions (the gated attention's output gate, the router's expert bias, the
    all-to-all dispatcher's preprocessing, ...) in `megatron.core.jit.jit_fuser`, torch.compile on torch >= 2.2. On
    the CPU, inductor compiles each one in every process at its first call (Qwen3-Next's output gate: 4.4 s of a
    first training step that otherwise takes 0.04 s) into kernels that need not round as the eager ops transformers
    runs. With dynamo off they run eagerly; torch.compile of anything else on a CPU-only machine runs eagerly too."""
    import torch._dynamo  # megatron imports it anyway; not at this module's import

    _OWNERS["torch._dynamo.config"] = torch._dynamo.config
    _patch(torch._dynamo.config, "disable", True)


def _patch_megatron_rng() -> None:
    """Activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA generator's state around the
    recomputed forward; on the CPU the generator that matters is torch's CPU one, which megatron already saves
    too. Its two CUDA state helpers are pointed at the CPU generator (module attributes, looked up per call)."""
    from megatron.core.tensor_parallel import random as megatron_random

    _OWNERS["megatron.core.tensor_parallel.random"] = megatron_random

    def get_state(*args, **kwargs):
        _record("megatron _get_cuda_rng_state")
        return torch.get_rng_state()

    def set_state(new_state, *args, **kwargs):
        _record("megatron _set_cuda_rng_state")
        torch.set_rng_state(new_state)

    _patch(megatron_random, "_get_cuda_rng_state", get_state)
    _patch(megatron_random, "_set_cuda_rng_state", set_state)


def _patch_moe() -> None:
    """The mixture-of-experts layers' CUDA streams, buffers and gloo gaps (toolkit/backend/cpu_moe.py)."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import token_dispatcher

    from toolkit.backend import cpu_moe

    _OWNERS["megatron.core.transformer.moe.token_dispatcher"] = token_dispatcher
    _OWNERS["torch.distributed"] = dist
    cpu_moe.install(patch=_patch, null_stream=_NullStream, wrap_factory=_wrap_factory)


def _patch_mla() -> None:
    """Multi-latent attention (megatron.core.transformer.multi_latent_attention:130/138) builds its rotary module
    without `use_cpu_initialization`, so the module enters `torch.device(torch.cuda.current_device())`, which no
    redirection of factories can reach; on the CPU it is built as GPTModel builds its own, on the CPU."""
    from megatron.core.transformer import multi_latent_attention

    _OWNERS["megatron.core.transformer.multi_latent_attention"] = multi_latent_attention
    for name in ("RotaryEmbedding", "YarnRotaryEmbedding"):
        _patch(multi_latent_attention, name, _built_on_cpu(getattr(multi_latent_attention, name)))


def _built_on_cpu(rotary_class: type) -> type:
    """`rotary_class` constructed with use_cpu_initialization=True (a subclass, so isinstance checks still hold)."""

    class OnCpu(rotary_class):
        def __init__(self, *args, **kwargs):
            _record(f"{rotary_class.__name__} in multi-latent attention")
            super().__init__(*args, **{**kwargs, "use_cpu_initialization": True})

    OnCpu.__name__ = OnCpu.__qualname__ = rotary_class.__name__
    return OnCpu


def _patch(owner, attr: str, replacement) -> None:
    owner_name = {id(v): k for k, v in _OWNERS.items()}[id(owner)]
    _originals[f"{owner_name}:{attr}"] = getattr(owner, attr)
    _replacements[f"{owner_name}:{attr}"] = replacement
    setattr(owner, attr, replacement)


def reapply() -> list[str]:
    """Put back the redirections something replaced since `install()`; returns what was put back. DeepSpeed's
    zero.Init swaps torch's tensor factories for its own while it builds and, at exit, restores the ones it found
    when DeepSpeed was IMPORTED: in a process that imported DeepSpeed before the CPU backend was installed (a
    user's script, a test session) those are torch's own, and every later `torch.empty(device=0)` of megatron's
    would ask for a GPU. Ranks install first and import DeepSpeed after; toolkit/adapters/zero3.py calls this
    after each zero.Init."""
    restored = []
    with _lock:
        if not _installed:
            return restored
        for key, replacement in _replacements.items():
            owner_name, attr = key.split(":")
            current = getattr(_OWNERS[owner_name], attr)
            if current is not replacement:
                _originals[key] = current
                setattr(_OWNERS[owner_name], attr, replacement)
                restored.append(key)
    return restored


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # megatron passes torch.cuda.current_device(), an int
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _record(api: str) -> None:
    frame = sys._getframe(2)
    path = frame.f_code.co_filename
    for marker in ("/megatron/", "/deepspeed/", "/toolkit/", "/transformers/", "/torch/"):
        if marker in path:
            path = path[path.rindex(marker) + 1 :]
            break
    redirected_sites[(api, f"{path}:{frame.f_lineno}")] += 1


def _wrap_factory(factory, api: str):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            _record(api)
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


def _wrap_to(original_to):
    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            _record("Tensor.to")
            args = ("cpu",) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            _record("Tensor.to")
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    return to


def _tensor_cuda(self, *args, **kwargs):
    _record("Tensor.cuda")
    return self


def _current_device() -> int:
    # An int, as on CUDA: callers pass it on as `device=`, which the wrapped factories map back to the CPU.
    _record("torch.cuda.current_device")
    return 0


class _NullStream:
    """Stands in for a CUDA stream: on the CPU every operation is already ordered, so waits are no-ops."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _current_stream(*args, **kwargs) -> _NullStream:
    _record("torch.cuda.current_stream")
    return _NullStream()


def _noop(api: str):
    def noop(*args, **kwargs):
        _record(api)
        return None

    return noop
