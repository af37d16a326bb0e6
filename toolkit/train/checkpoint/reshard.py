"""Resume at another layout: a layout-free copy of the training state, written beside every engine checkpoint.

DeepSpeed's engine checkpoint (toolkit/train/checkpoint/checkpoints.py) is tied to the layout that wrote it: one model file
per TP x PP rank, one optimizer partition per DP rank. A run that comes back on another number of GPUs, or with
another TP / PP / VPP / DP / ZeRO stage, resumes from this copy instead:

    <tag>/layout-free/      megatron-core dist_checkpointing (torch_dist): for every trainable parameter its fp32
                            master weight and Adam's exp_avg / exp_avg_sq, under megatron's layout-free keys
                            (`master.decoder.layers.self_attention.linear_qkv.weight`, ...)
    <tag>/dsmt_layout.json  the layout that wrote it, every parameter's global shape, Adam's step count and the
                            optimizer's hyper-parameters (lr, betas, ...), the LR scheduler's state

Why dist_checkpointing rather than DeepSpeed's universal checkpoint: megatron-core's `sharded_state_dict()` says
where each TP / PP shard of each parameter sits in the global tensor (fused QKV, interleaved SwiGLU, the layer
offsets of pipeline and virtual stages) and dist_checkpointing reshards on load; dsmt's megatron checkpoints use
the same machinery. DeepSpeed's universal checkpoint describes TP slicing with Megatron-DeepSpeed's parameter-name
patterns, which do not know megatron-core's fused layouts. The optimizer state goes in and out through DeepSpeed's
own accessors (`safe_get_full_*` / `safe_set_full_*`: ZeRO 1-3 and the bf16 optimizer).

Frozen parameters (the base weights under LoRA) have no optimizer state: a resumed run reads them from the model
it starts from, as the first run did. The data position is the step (batches are a function of the step and the
global batch, toolkit/data/batches.py), so the global batch size must stay the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.errors import DsmtError

LAYOUT_FREE = "layout-free"
RECORD = "dsmt_layout.json"
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's, under the names torch, FusedAdam and DeepSpeed's CPU Adam share
SCHEDULED = ("lr", "betas", "initial_lr")  # optimizer hyper-parameters DeepSpeed's LR schedulers set


def layout_record(*, layout, zero_stage: int) -> dict:
    """What ties a DeepSpeed engine checkpoint to its writer: equal records resume through DeepSpeed itself."""
    return {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "dp": layout.dp,
            "ep": layout.ep, "zero_stage": zero_stage, "world_size": layout.world_size}


def describe(record: dict) -> str:
    expert = f" ep={record['ep']}" if record.get("ep", 1) > 1 else ""
    return (f"tp={record['tp']} pp={record['pp']} vpp={record['vpp']} cp={record['cp']}{expert} dp={record['dp']} "
            f"zero={record['zero_stage']} ({record['world_size']} ranks)")


class LayoutFreeState:
    """Save and load one rank's share of the layout-free state of a megatron-core + DeepSpeed run (every rank
    calls both: they are collective over the data-parallel group and over the whole job)."""

    def __init__(self, *, engine, chunks: list, layout: dict, global_batch_size: int):
        self.engine, self.chunks, self.layout, self.global_batch_size = engine, chunks, layout, global_batch_size

    def save(self, tag_dir: Path) -> None:
        """Write <tag>/layout-free and <tag>/dsmt_layout.json (after DeepSpeed has written <tag>)."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        from toolkit.convert.threaded_save import threaded_save_strategy

        shards = trainable_shards(self.chunks)
        link_optimizer_fragments(self.engine)
        sharded = {}
        for key, (param, item, _) in shards.items():  # the same keys in the same order on every rank of a DP group
            for name in ("master", *MOMENTS):
                value = full_value(self.engine, param, state_key=None if name == "master" else name)  # collective
                sharded[f"{name}/{key}"] = make_sharded_optimizer_tensor(item, held_for_save(value, item), name)
        record = self._record(shards)
        refuse_unless_it_fits(tag_dir, sharded=sharded)
        if dist.get_rank() == 0:
            (tag_dir / LAYOUT_FREE).mkdir(exist_ok=True)  # a fresh .partial- folder: nothing of another save
        dist.barrier()
        # threads, not megatron's forked writers and spawned Manager (toolkit/convert/threaded_save.py)
        dist_checkpointing.save(sharded, str(tag_dir / LAYOUT_FREE), sharded_strategy=threaded_save_strategy())
        if dist.get_rank() == 0:
            (tag_dir / RECORD).write_text(json.dumps(record, indent=1))

    def _record(self, shards: dict) -> dict:
        base = base_optimizer(self.engine)
        # What the LR scheduler moves (the weight decay is per group and comes from the spec, like the rest).
        hyper = {k: v for k, v in base.param_groups[0].items() if k in SCHEDULED}
        scheduler = self.engine.lr_scheduler
        return {"layout": self.layout, "global_batch_size": self.global_batch_size,
                "parameters": global_shapes(shards), "optimizer_step": optimizer_step(base),
                "optimizer_hyperparameters": hyper, "global_steps": self.engine.global_steps,
                "global_samples": self.engine.global_samples,
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None}

    def check(self, tag_dir: Path, *, shards: dict | None = None) -> dict:
        """The saved record, after checking that this run can take it (the same on every rank: all raise or none).
        `shards`: `trainable_shards(self.chunks)` when the caller has them already."""
        if not (tag_dir / RECORD).is_file() or not (tag_dir / LAYOUT_FREE / "metadata.json").is_file():
            raise DsmtError(f"checkpoint {tag_dir.name} has no layout-free state ({RECORD}, {LAYOUT_FREE}/): it was "
                            "written before dsmt saved one, so it resumes only at the layout that wrote it")
        record = json.loads((tag_dir / RECORD).read_text())
        shards = trainable_shards(self.chunks) if shards is None else shards
        problems = shape_problems(saved=record["parameters"], current=global_shapes(shards))
        if record["global_batch_size"] != self.global_batch_size:
            problems.append(f"global batch {record['global_batch_size']} -> {self.global_batch_size}: the data "
                            "position and the LR schedule count steps of the global batch; keep "
                            f"training.global_batch_size={record['global_batch_size']}")
        if problems:
            raise DsmtError(f"checkpoint {tag_dir} cannot be resumed by this run ({describe(record['layout'])} -> "
                            f"{describe(self.layout)}):\n  " + "\n  ".join(problems) +
                            "\nresume with the spec that wrote it, or start a new output_dir from its exported "
                            "model (final-hf / final-mcore)")
        return record

    def load(self, tag_dir: Path) -> dict:
        """Set master weights, model weights, Adam moments and step, hyper-parameters and the LR schedule from
        <tag>; returns the record. Reads only: the checkpoint is never modified."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        from toolkit.adapters.load import full_shape

        shards = trainable_shards(self.chunks)
        record = self.check(tag_dir, shards=shards)
        template = {f"{name}/{key}": make_sharded_optimizer_tensor(
                        item, torch.empty(full_shape(param), dtype=torch.float32), name)
                    for key, (param, item, _) in shards.items() for name in ("master", *MOMENTS)}
        loaded = dist_checkpointing.load(template, str(tag_dir / LAYOUT_FREE))
        base = base_optimizer(self.engine)
        materialize_optimizer_state(self.engine, base)
        device = next(iter(shards.values()))[0].device if shards else torch.device("cpu")
        for key, (param, _, _) in shards.items():
            set_master(param, loaded[f"master/{key}"].to(device))
            for name in MOMENTS:
                set_state(self.engine, param, loaded[f"{name}/{key}"].to(device), state_key=name)
        set_optimizer_step(base, record["optimizer_step"])
        for group in base.param_groups:
            group.update(record["optimizer_hyperparameters"])
        if record["lr_scheduler"] is not None and self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(record["lr_scheduler"])
        self.engine.global_steps, self.engine.global_samples = record["global_steps"], record["global_samples"]
        return record


def refuse_unless_it_fits(tag_dir: Path, *, sharded: dict) -> None:
    """The named `disk_full` on every rank, before a byte of the copy is written, when the filesystem has not room
    for it: the copy's size is known here, unlike the engine checkpoint's before the first save, and a disk that
    fills mid-write leaves torch.distributed.checkpoint's writer threads failing one after the other. Collective."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from toolkit.launch.rank0 import on_rank0
    from toolkit.train.checkpoint import space
    from toolkit.train.checkpoint.folders import checkpoint_io_error

    mine = sum(item.data.numel() * item.data.element_size() for item in sharded.values()
               if is_main_replica(item.replica_id))  # the other replicas are stand-ins megatron drops
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    refusal = on_rank0(lambda: space.copy_refusal(directory=tag_dir, needed=sum(every)),
                       what=f"checking the free space for {tag_dir / LAYOUT_FREE}", os_error=checkpoint_io_error)
    if refusal:
        raise space.DiskFull(refusal)


def held_for_save(value: torch.Tensor, item) -> torch.Tensor:
    """What this rank keeps of a gathered value until `dist_checkpointing.save`: an fp32 host copy where it writes
    the item (megatron's main replica: DP rank 0, and TP rank 0 for a TP-replicated norm), else a 4-byte stand-in
    of the same shape. megatron's torch_dist save drops every other replica before it reads any data
    (`keep_only_main_replica`), so the other DP replicas need not hold the model's fp32 master weights and both
    Adam moments in host memory (~24 GB per rank at 8B, TP2 x PP2) at every save."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    if is_main_replica(item.replica_id):
        return value.detach().float().cpu()
    return torch.zeros((), dtype=torch.float32).expand(value.shape)


def trainable_shards(chunks: list) -> dict:
    """This rank's name -> (parameter, its ShardedTensor / ShardedTensorFactory, its global shape) for every
    parameter that trains on this rank. The item's key is layout-free (the layers share one stacked key, each
    layer a slice of it); the name (`chunk index/local key`) only tells this rank's entries apart. ZeRO-3
    parameters are matched through full-shape stand-ins (toolkit/adapters/load.py)."""
    from toolkit.adapters.load import full_shape_standins

    every = [p for chunk in chunks for p in chunk.parameters()]  # frozen ones too: megatron reads every shape
    params = [p for p in every if p.requires_grad]
    found: dict = {}
    with full_shape_standins(every):
        by_pointer = {p.data_ptr(): p for p in params}
        for index, chunk in enumerate(chunks):
            for local_key, item in chunk.sharded_state_dict().items():
                data = getattr(item, "data", None)
                if isinstance(data, torch.Tensor) and data.data_ptr() in by_pointer:
                    found[f"{index}/{local_key}"] = (by_pointer[data.data_ptr()], item, _global_shape(item))
    if len(found) != len(params):
        raise DsmtError(f"{len(params) - len(found)} trainable parameters have no entry in megatron's sharded state "
                        "dict, so they cannot be saved layout-free (a dsmt bug: report it with the model family)")
    return found


def global_shapes(shards: dict) -> dict[str, list[int]]:
    """Every rank's parameters with their global shapes (the layout-free identity of the model); collective."""
    import torch.distributed as dist

    local = {item.key: shape for _, item, shape in shards.values()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {key: shape for part in gathered for key, shape in sorted(part.items())}


def _global_shape(item) -> list:
    """A ShardedTensor's global shape; a ShardedTensorFactory (megatron's SwiGLU fc1) has none, its parts do (built
    here, while a ZeRO-3 parameter still holds its full-shape stand-in)."""
    if hasattr(item, "global_shape"):
        return list(item.global_shape)
    built = item.build()
    parts = built.values() if isinstance(built, dict) else built
    return [list(part.global_shape) for part in parts]


def shape_problems(*, saved: dict, current: dict) -> list[str]:
    problems = [f"{key}: this run has no such parameter (checkpoint shape {saved[key]})"
                for key in saved if key not in current]
    problems += [f"{key}: not in the checkpoint (this run's shape {current[key]})"
                 for key in current if key not in saved]
    problems += [f"{key}: checkpoint shape {saved[key]}, this run's {current[key]}"
                 for key in current if key in saved and _plain(saved[key]) != _plain(current[key])]
    return problems


def _plain(shape):
    return json.loads(json.dumps(shape))  # tuples and lists compare equal after a JSON round trip


def base_optimizer(engine):
    """The torch optimizer that holds Adam's state (inside DeepSpeed's ZeRO / bf16 wrapper when there is one)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def held_by_deepspeed(param) -> bool:
    """Whether DeepSpeed keeps `param`'s fp32 master and Adam state apart from it (ZeRO-3: `ds_id`; ZeRO-1/2 and
    the bf16 optimizer: `_hp_mapping`), reached through its `safe_*` accessors."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def full_value(engine, param, *, state_key: str | None) -> torch.Tensor:
    """The whole (this TP shard's) fp32 master weight, or Adam state `state_key`, of `param`; collective over the
    DP group under ZeRO."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if held_by_deepspeed(param):
        if state_key is None:
            return safe_get_full_fp32_param(param)
        return safe_get_full_optimizer_state(param, state_key)
    # No wrapper (ZeRO-0 in fp32): the parameter is its own master and torch's state is keyed by it.
    return param.detach() if state_key is None else base_optimizer(engine).state[param][state_key]


def set_master(param, value: torch.Tensor) -> None:
    """The fp32 master weight and the model's (low-precision) weight from one whole value."""
    from deepspeed.utils import safe_set_full_fp32_param

    from toolkit.adapters.zero3 import is_partitioned, load_partitioned

    if held_by_deepspeed(param):
        safe_set_full_fp32_param(param, value)
    if is_partitioned(param):
        load_partitioned(param, lambda: value.to(param.dtype))
    else:
        param.data.copy_(value.to(param.dtype))


def set_state(engine, param, value: torch.Tensor, *, state_key: str) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    if held_by_deepspeed(param):
        safe_set_full_optimizer_state(param, value, state_key)
    else:
        base_optimizer(engine).state[param][state_key].copy_(value)


def materialize_optimizer_state(engine, base) -> None:
    """Adam creates its state at the first step; a resumed run sets it before any step. One step with zero
    gradients at lr 0 makes the optimizer create its own state (whatever its kind) without moving a weight; the
    values are overwritten next. ZeRO-3 puts its flat fp32 partitions into the optimizer's groups only around its
    own step (`_set_fp32_optimizer_param_groups`), so they are put there for this one too."""
    wrapper = engine.optimizer
    staged = hasattr(wrapper, "_set_fp32_optimizer_param_groups") and not any(g["params"] for g in base.param_groups)
    if staged:
        wrapper._set_fp32_optimizer_param_groups()
    try:
        params = [p for group in base.param_groups for p in group["params"]]
        if not all(set(MOMENTS) <= set(base.state.get(p, {})) for p in params):
            _zero_step(base, params)
    finally:
        if staged:
            wrapper._clear_fp32_optimizer_param_groups()
    link_optimizer_fragments(engine)


def _zero_step(base, params: list) -> None:
    rates = [group["lr"] for group in base.param_groups]
    for group in base.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    base.step()
    for group, rate in zip(base.param_groups, rates):
        group["lr"] = rate
    for param in params:
        param.grad = None


def link_optimizer_fragments(engine) -> None:
    """Point each parameter's fragment (what `safe_*_optimizer_state` reads and writes) at Adam's state of its
    group. DeepSpeed 0.19's ZeRO-1/2 and bf16 wrappers link every group once, right after the FIRST group's
    step, when the later groups (dsmt has two: decay and no decay) have no state yet; their fragments would stay
    empty ("exp_avg not found in optimizer state fragment"). Linking again is idempotent. ZeRO-3 reads Adam's
    state directly."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    wrapper, base = engine.optimizer, base_optimizer(engine)
    pairs = (("bit16_groups", "single_partition_of_fp32_groups"), ("bf16_groups", "fp32_groups_flat_partition"))
    for low, high in pairs:
        if hasattr(wrapper, low) and hasattr(wrapper, high):
            for low_params, flat in zip(getattr(wrapper, low), getattr(wrapper, high)):
                lazy_init_hp_params_optimizer_state(low_params, flat, base.state)
            return


def optimizer_step(base) -> int | None:
    """Adam's step count: per parameter state in torch and DeepSpeed's CPU Adam, per group in FusedAdam."""
    for state in base.state.values():
        if "step" in state:
            return int(state["step"])
    steps = [group["step"] for group in base.param_groups if "step" in group]
    return int(steps[0]) if steps else None


def set_optimizer_step(base, step: int | None) -> None:
    if step is None:
        return
    for state in base.state.values():
        if "step" in state:
            state["step"] = torch.full_like(state["step"], step) if torch.is_tensor(state["step"]) else step
    for group in base.param_groups:
        if "step" in group:
            group["step"] = step
