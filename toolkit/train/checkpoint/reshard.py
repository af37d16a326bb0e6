"""Resume at another layout: the record of a checkpoint's layout-free state, its checks, and its load.

A checkpoint's optimizer state is saved fully sharded and layout-free (toolkit/train/checkpoint/sharded.py):
every rank's ZeRO fragments of the fp32 master weights and Adam moments, as blocks of megatron-core's layout-free
tensors. Beside it:

    <tag>/dsmt_layout.json  the layout that wrote it, every parameter's global shape, Adam's step count and the
                            optimizer's hyper-parameters (lr, betas, ...), the LR scheduler's state, DeepSpeed's step
                            counters and fp16's loss scale

so that a run at any TP / PP / VPP / DP / EP / ZeRO stage (or the same one) resumes from it. Why megatron-core's
`sharded_state_dict()` describes the layout rather than DeepSpeed's universal checkpoint: it says where each TP /
PP shard of each parameter sits in the global tensor (fused QKV, interleaved SwiGLU, the layer offsets of pipeline
and virtual stages); DeepSpeed's universal checkpoint describes TP slicing with Megatron-DeepSpeed's
parameter-name patterns, which do not know megatron-core's fused layouts.

Checkpoints of an older dsmt held the same state as megatron-core dist_checkpointing files (`<tag>/layout-free/`,
every parameter's full fp32 values written by DP rank 0); they still load (`load_legacy`).

Frozen parameters (the base weights under LoRA) have no optimizer state: a resumed run reads them from the model
it starts from, as the first run did. The data position is the step (batches are a function of the step and the
global batch, toolkit/data/batches.py), so the global batch size must stay the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.errors import DsmtError
from toolkit.train.checkpoint.sharded import MOMENTS, base_optimizer

LAYOUT_FREE = "layout-free"
RECORD = "dsmt_layout.json"
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
    """One rank's share of the layout-free state of a megatron-core + DeepSpeed run: taken for a save
    (toolkit/train/checkpoint/sharded.py), checked and loaded at resume. Collective where said."""

    def __init__(self, *, engine, chunks: list, layout: dict, global_batch_size: int):
        self.engine, self.chunks, self.layout, self.global_batch_size = engine, chunks, layout, global_batch_size
        self._reads: dict = {}  # tag dir -> this rank's `sharded.plan_reads` (planned to verify, kept to load)

    def take(self, *, copy: bool):
        """(this rank's `sharded.Share`, the record every rank has). Collective (the shapes are gathered)."""
        import torch.distributed as dist

        from toolkit.train.checkpoint.sharded import take_share

        shards = trainable_shards(self.chunks)
        link_optimizer_fragments(self.engine)
        return take_share(self.engine, shards, rank=dist.get_rank(), copy=copy), self._record(shards)

    def _record(self, shards: dict) -> dict:
        base = base_optimizer(self.engine)
        # What the LR scheduler moves (the weight decay is per group and comes from the spec, like the rest).
        hyper = {k: v for k, v in base.param_groups[0].items() if k in SCHEDULED}
        scheduler = self.engine.lr_scheduler
        return {"layout": self.layout, "global_batch_size": self.global_batch_size,
                "parameters": global_shapes(shards), "optimizer_step": optimizer_step(base),
                "optimizer_hyperparameters": hyper, "global_steps": self.engine.global_steps,
                "global_samples": self.engine.global_samples, "skipped_steps": int(self.engine.skipped_steps),
                "loss_scaler": loss_scaler_state(self.engine.optimizer),
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None}

    def check(self, tag_dir: Path, *, shards: dict | None = None) -> dict:
        """The saved record, after checking that this run can take it (the same on every rank: all raise or none).
        `shards`: `trainable_shards(self.chunks)` when the caller has them already."""
        from toolkit.train.checkpoint.sharded import INDEX

        state = (tag_dir / INDEX).is_file() or (tag_dir / LAYOUT_FREE / "metadata.json").is_file()
        if not (tag_dir / RECORD).is_file() or not state:
            raise DsmtError(f"checkpoint {tag_dir.name} has no layout-free state ({RECORD}, {INDEX}): it was "
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

    def files_to_read(self, tag_dir: Path) -> dict[str, int] | None:
        """{relative path: bytes} of what this rank reads to resume from `tag_dir` (its index, its record and the
        blocks its fragments need), None for a checkpoint of the older format or an index that cannot be read
        (then every file is checked). Collective: rank 0 reads the index for all."""
        import torch.distributed as dist

        from toolkit.train.checkpoint.sharded import INDEX, files_read, plan_reads

        shared = [None]
        if dist.get_rank() == 0 and (tag_dir / INDEX).is_file():
            try:
                shared = [json.loads((tag_dir / INDEX).read_text())]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                shared = [None]  # damaged: the check of every file names it
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is None:
            return None
        try:
            reads = plan_reads(trainable_shards(self.chunks), shared[0])
        except (DsmtError, KeyError, TypeError, ValueError):
            return None  # then every rank checks every file (integrity.verdict_collectively); `load` names it
        self._reads[tag_dir] = reads
        counts = files_read(reads)
        extra = {INDEX: 1, RECORD: 1} if dist.get_rank() == 0 else {}
        return {**counts, **extra, f"dsmt_rng_rank{dist.get_rank()}.pt": 1}

    def _planned(self, tag_dir: Path, *, shards: dict) -> list:
        """This rank's reads of `tag_dir` (planned when its files were checked, else now); a plan that fails on
        any rank raises on every rank (the load's collectives must not wait for a rank that stopped). Collective."""
        import torch.distributed as dist

        from toolkit.train.checkpoint.sharded import INDEX, plan_reads

        reads, problem = self._reads.pop(tag_dir, None), None
        if reads is None:
            try:
                reads = plan_reads(shards, json.loads((tag_dir / INDEX).read_text()))
            except (DsmtError, OSError, KeyError, TypeError, ValueError) as err:
                problem = f"rank {dist.get_rank()}: {err}"
        problems: list = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise DsmtError(f"checkpoint {tag_dir} cannot be read by this run: {next(p for p in problems if p)}\n"
                            f"fix: `dsmt checkpoint verify {tag_dir.parent}`; resume from an older checkpoint "
                            "(move this one aside) or with the spec that wrote it")
        return reads

    def load(self, tag_dir: Path) -> dict:
        """Set master weights, model weights, Adam moments and step, hyper-parameters, the loss scale and the LR
        schedule from <tag>; returns the record. Reads only: the checkpoint is never modified."""
        from toolkit.train.checkpoint.sharded import INDEX, load_share

        shards = trainable_shards(self.chunks)
        record = self.check(tag_dir, shards=shards)
        base = base_optimizer(self.engine)
        materialize_optimizer_state(self.engine, base)
        if (tag_dir / INDEX).is_file():
            load_share(self.engine, shards, tag_dir, self._planned(tag_dir, shards=shards))
        else:
            load_legacy(self.engine, shards, tag_dir)
        set_optimizer_step(base, record["optimizer_step"])
        for group in base.param_groups:
            group.update(record["optimizer_hyperparameters"])
        if record["lr_scheduler"] is not None and self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(record["lr_scheduler"])
        self.engine.global_steps, self.engine.global_samples = record["global_steps"], record["global_samples"]
        self.engine.skipped_steps = record.get("skipped_steps", self.engine.skipped_steps)
        set_loss_scaler_state(self.engine.optimizer, record.get("loss_scaler"))
        return record


SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")  # DeepSpeed's dynamic loss scale


def loss_scaler_state(wrapper) -> dict | None:
    """fp16's dynamic loss scale as it stands (None: no loss scaler, as in bf16 and fp32)."""
    scaler = getattr(wrapper, "loss_scaler", None)
    if scaler is None:
        return None
    values = {name: getattr(scaler, name) for name in SCALER_FIELDS if hasattr(scaler, name)}
    return {name: value.item() if torch.is_tensor(value) else value for name, value in values.items()}


def set_loss_scaler_state(wrapper, state: dict | None) -> None:
    scaler = getattr(wrapper, "loss_scaler", None)
    if scaler is None or not state:
        return
    for name, value in state.items():
        current = getattr(scaler, name, None)
        setattr(scaler, name, torch.full_like(current, value) if torch.is_tensor(current) else value)


def load_legacy(engine, shards: dict, tag_dir: Path) -> None:
    """The optimizer state of a checkpoint written before dsmt sharded it: megatron's dist_checkpointing copy in
    <tag>/layout-free/, full fp32 values per parameter (each DP rank reads them whole and keeps its part)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from toolkit.adapters.load import full_shape

    template = {f"{name}/{key}": make_sharded_optimizer_tensor(
                    item, torch.empty(full_shape(param), dtype=torch.float32), name)
                for key, (param, item, _, _) in shards.items() for name in ("master", *MOMENTS)}
    loaded = dist_checkpointing.load(template, str(tag_dir / LAYOUT_FREE))
    device = next(iter(shards.values()))[0].device if shards else torch.device("cpu")
    for key, (param, _, _, _) in shards.items():
        set_master(param, loaded[f"master/{key}"].to(device))
        for name in MOMENTS:
            set_state(engine, param, loaded[f"{name}/{key}"].to(device), state_key=name)


def trainable_shards(chunks: list) -> dict:
    """This rank's name -> (parameter, its ShardedTensor / ShardedTensorFactory, its global shape, its
    `fragments.Piece`s) for every parameter that trains on this rank. The item's key is layout-free (the layers
    share one stacked key, each layer a slice of it); the name (`chunk index/local key`) only tells this rank's
    entries apart. ZeRO-3 parameters are matched through full-shape stand-ins (toolkit/adapters/load.py)."""
    from toolkit.adapters.load import full_shape_standins
    from toolkit.train.checkpoint.fragments import param_pieces

    every = [p for chunk in chunks for p in chunk.parameters()]  # frozen ones too: megatron reads every shape
    params = [p for p in every if p.requires_grad]
    found: dict = {}
    with full_shape_standins(every):
        by_pointer = {p.data_ptr(): p for p in params}
        for index, chunk in enumerate(chunks):
            for local_key, item in chunk.sharded_state_dict().items():
                data = getattr(item, "data", None)
                if isinstance(data, torch.Tensor) and data.data_ptr() in by_pointer:
                    param = by_pointer[data.data_ptr()]
                    pieces = param_pieces(item, shape=tuple(param.shape), dtype=param.dtype)
                    found[f"{index}/{local_key}"] = (param, item, _global_shape(item), pieces)
    if len(found) != len(params):
        raise DsmtError(f"{len(params) - len(found)} trainable parameters have no entry in megatron's sharded state "
                        "dict, so they cannot be saved layout-free (a dsmt bug: report it with the model family)")
    return found


def global_shapes(shards: dict) -> dict[str, list[int]]:
    """Every rank's parameters with their global shapes (the layout-free identity of the model); collective."""
    import torch.distributed as dist

    local = {item.key: shape for _, item, shape, _ in shards.values()}
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


def held_by_deepspeed(param) -> bool:
    """Whether DeepSpeed keeps `param`'s fp32 master and Adam state apart from it (ZeRO-3: `ds_id`; ZeRO-1/2 and
    the bf16 optimizer: `_hp_mapping`), reached through its `safe_*` accessors."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


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
