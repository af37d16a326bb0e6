"""ZeRO-3 around megatron-core chunks, one parameter at a time: built partitioned, loaded, exported.

  build   `partitioned_build(ds_config)` wraps the GPTModel construction in `deepspeed.zero.Init` over megatron's
          data-parallel group: each module's parameters are partitioned as soon as that module is constructed, so
          a rank never holds more than its 1/dp share plus the module being built (at most one layer's linear).
  load    `load_partitioned` (the `write` of `toolkit.adapters.load.load_hf_weights`) gathers one parameter, lets
          the group's first rank write the checkpoint's value and broadcasts it on exit
          (`GatheredParameters(modifier_rank=0)`). DeepSpeed keeps a modification only when a modifier rank is
          given: with `modifier_rank=None` it re-partitions the OLD values, whatever every rank wrote.
  export  `params_on_cpu(module)` gathers one parameter at a time into a CPU copy for megatron's dist_checkpointing
          (which needs whole TP shards), instead of gathering every parameter on the device at once.
`deepspeed.initialize` takes zero.Init parameters as they are (it converts only parameters without `ds_id`).
"""

from __future__ import annotations

import contextlib

import torch


def zero3_gathered(engine):
    """Context in which every parameter of `engine.module` is whole on every rank (a no-op below ZeRO-3). Gathers
    the whole model on the device: for small models (the plain-HF trainer); the hybrid export uses `params_on_cpu`."""
    import deepspeed

    if engine.zero_optimization_stage() < 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def partitioned_build(ds_config: dict | None):
    """Context for building model chunks: partitioned over megatron's DP group when `ds_config` is a ZeRO-3
    DeepSpeed config, a no-op when it is None. The partitions go where the config says (`offload_param.device`,
    else this rank's device): zero.Init reads `remote_device` from the config when given None."""
    if ds_config is None:
        return contextlib.nullcontext()
    import deepspeed

    from toolkit.parallel.mpu import MegatronMpu

    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage != 3:
        raise ValueError(f"partitioned_build needs a ZeRO-3 DeepSpeed config, got zero_optimization.stage={stage}")
    # zero.Init reads the DP size through deepspeed.comm, which wraps the existing torch.distributed group only
    # once initialised (deepspeed.initialize would do it later); uninitialised, it silently assumes one rank.
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False, verbose=False)
    mpu = MegatronMpu()
    return _redirections_kept(deepspeed.zero.Init(data_parallel_group=mpu.get_data_parallel_group(), mpu=mpu,
                                                  config_dict_or_path=ds_config, remote_device=None, enabled=True))


@contextlib.contextmanager
def _redirections_kept(init):
    """zero.Init, after which the CPU backend's redirections are what they were (toolkit/backend/cpu.py `reapply`:
    zero.Init restores the torch factories DeepSpeed saw at its import, which may predate them)."""
    try:
        with init:
            yield
    finally:
        if not torch.cuda.is_available():
            from toolkit.backend import cpu

            cpu.reapply()


@torch.no_grad()
def load_partitioned(param: torch.Tensor, value) -> None:
    """Write a whole (TP-shard) value into a partitioned parameter. `value` is a callable producing it; it is
    called on the DP group's first rank only (the others skip reading the checkpoint) and broadcast from there."""
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if dist.get_rank(group=param.ds_process_group) == 0:
            param.data.copy_(value())


@contextlib.contextmanager
def params_on_cpu(module: torch.nn.Module):
    """Inside, every ZeRO-3 parameter of `module` holds a whole CPU copy (gathered one parameter at a time, so the
    device never holds more than its share plus one parameter); the partitions are untouched and restored on exit.
    A no-op for modules that are not partitioned. Nothing may run forward or backward inside."""
    import deepspeed

    saved = []
    try:
        for param in module.parameters():
            if not is_partitioned(param):
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                copy = param.data.detach().to("cpu", copy=True)
            saved.append((param, param.data))
            param.data = copy
        yield
    finally:
        for param, data in saved:
            param.data = data
