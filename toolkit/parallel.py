"""The parallel topology as one explicit value, checked once against the model, and the process-group set-up."""

from __future__ import annotations

import dataclasses
import datetime

from toolkit.errors import DsmtError


class LayoutError(DsmtError):
    """A TP / PP / VPP / DP layout that does not fit the model or the world."""


def divisors(n: int) -> list[int]:
    """1..n values dividing n: the candidates every layout rule lists as valid choices."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Layout:
    tp_size: int = 1
    pp_size: int = 1
    vpp_size: int = 1  # model chunks per pipeline stage (interleaved 1F1B when > 1)
    dp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def model_parallel_size(self) -> int:
        return self.tp_size * self.pp_size

    def problems(self, *, num_attention_heads: int, num_query_groups: int, num_layers: int, padded_vocab_size: int) -> list[str]:
        """Every way this layout fails the model, each naming the values and the valid choices."""
        tp, found = self.tp_size, []
        for name, value in (("tp_size", tp), ("pp_size", self.pp_size), ("vpp_size", self.vpp_size), ("dp_size", self.dp_size)):
            if value < 1:
                found.append(f"{name}={value} must be >= 1")
        if found:
            return found
        valid_tp = [t for t in divisors(num_attention_heads)
                    if (num_query_groups % t == 0 or t % num_query_groups == 0) and padded_vocab_size % t == 0]
        if num_attention_heads % tp:
            found.append(f"tp_size={tp} does not divide num_attention_heads={num_attention_heads}; valid tp_size: {_fmt(valid_tp)}")
        elif num_query_groups % tp and tp % num_query_groups:
            found.append(f"tp_size={tp} and num_key_value_heads={num_query_groups}: one must divide the other "
                         f"(KV heads are split, or each replicated tp/kv times); valid tp_size: {_fmt(valid_tp)}")
        elif padded_vocab_size % tp:
            found.append(f"tp_size={tp} does not divide the padded vocabulary {padded_vocab_size}; valid tp_size: {_fmt(valid_tp)}")
        if self.vpp_size > 1 and self.pp_size == 1:
            found.append(f"vpp_size={self.vpp_size} needs pp_size > 1 (virtual stages interleave a pipeline)")
        chunks = self.pp_size * self.vpp_size
        if num_layers % chunks:
            valid_pp = [p for p in divisors(num_layers) if num_layers % (p * self.vpp_size) == 0]
            found.append(f"num_layers={num_layers} is not divisible by pp_size x vpp_size = {self.pp_size} x {self.vpp_size} "
                         f"= {chunks}; valid pp_size for vpp_size={self.vpp_size}: {_fmt(valid_pp)}")
        return found

    def check(self, **model_facts) -> None:
        problems = self.problems(**model_facts)
        if problems:
            raise LayoutError(f"layout {self} does not fit the model:\n  - " + "\n  - ".join(problems))


def _fmt(values: list[int]) -> str:
    return ", ".join(map(str, values)) or "none"


def init_process_groups(*, layout: Layout, dist_backend: str, timeout_s: float = 600.0) -> None:
    """This rank's own device (cuda:<LOCAL_RANK>), then torch.distributed (from the launcher's environment: RANK,
    WORLD_SIZE, MASTER_ADDR/PORT) bound to it, then megatron's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends

    device = backends.use_rank_device()  # before the group: NCCL and megatron's buffers use the current device
    if not dist.is_initialized():
        # device_id binds the NCCL communicators to this rank's GPU (gloo takes no device).
        bound = {"device_id": device} if dist_backend == "nccl" else {}
        dist.init_process_group(backend=dist_backend, timeout=datetime.timedelta(seconds=timeout_s), **bound)
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"world size {world} != tp_size x pp_size x dp_size = {layout.tp_size} x {layout.pp_size} x "
            f"{layout.dp_size} = {layout.world_size}; launch {layout.world_size} processes or change the layout"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        virtual_pipeline_model_parallel_size=layout.vpp_size if layout.vpp_size > 1 else None,
    )


def destroy_process_groups() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        destroy_world()


def destroy_world() -> None:
    """Destroy the default process group, through DeepSpeed when it has used it: DeepSpeed caches the world group
    (and its data-parallel groups) in module globals, and only its own destroy forgets them. A stale cache breaks
    the next `deepspeed.initialize` in this process ("Group ... is not registered")."""
    import sys

    import torch.distributed as dist

    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
