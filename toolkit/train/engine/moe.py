"""Mixture-of-experts training inside DeepSpeed: who does what with megatron-core's experts.

  megatron-core  the MoE layers: router, token dispatch (all-to-all over the EP group), the experts
                 (`SequentialMLP`, each rank building num_experts / ep of them), and the load-balancing loss, whose
                 gradient its router injects in backward (`MoEAuxLossAutoScaler`) and whose value it keeps in a
                 per-layer tracker. It marks expert weights `allreduce=False` when ep > 1.
  DeepSpeed      treats exactly those parameters as MoE parameters (`deepspeed.moe.utils.is_moe_param`): their
                 gradients are reduced over the expert-data-parallel group only (and divided by the full DP size,
                 as megatron's DDP does), their ZeRO-1/2 optimizer states partitioned over that group; every
                 other parameter over the whole data-parallel group. For that DeepSpeed needs, per parameter, the
                 name of its expert group (`param.group_name`), the groups themselves in `deepspeed.utils.groups`,
                 optimizer groups split per expert group, and its engine flag `has_moe_layers`, which it sets only
                 for its own `deepspeed.moe.layer.MoE` modules.
  dsmt           registers megatron's expert and expert-data-parallel groups under one name (`expert_group_name`),
                 tags the expert parameters, names the optimizer groups so that DeepSpeed can split them, sets
                 `has_moe_layers` for the duration of `deepspeed.initialize` (`deepspeed_sees_experts`), scales the
                 load-balancing gradient like the loss (`set_aux_loss_scale`), and reports the loss HF would
                 (`aux_loss_value`). docs/moe-notes.md, 5, has the runs that showed each step needed.
At ep = 1 nothing here applies: megatron leaves `allreduce` True, every expert is a plain replicated parameter.
ZeRO-3 with ep > 1 is refused before launch (DeepSpeed asserts "MoE not supported with Stage 3").
DeepSpeed's own checkpoint of the module keeps one EP rank's experts under local names, so dsmt checkpoints of
EP runs resume through megatron's dist_checkpointing copy (`toolkit/train/checkpoint/reshard.py`), never DeepSpeed's module file.
"""

from __future__ import annotations

import contextlib

import torch

from toolkit.errors import DsmtError


def is_moe(chunks: list) -> bool:
    return any(getattr(getattr(chunk, "config", None), "num_moe_experts", None) for chunk in chunks)


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for an expert-parallel group of `ep_size` ranks (what its own MoE layers use)."""
    return f"ep_size_{ep_size}"


def register_expert_groups(chunks: list) -> str | None:
    """Give DeepSpeed megatron's EP and expert-DP groups and tag every expert parameter with their name; returns
    the name (None at ep = 1, where nothing needs registering, and when no expert parameter trains). Collective at
    ep > 1: the ranks agree that experts train everywhere or nowhere (`_agree_on_experts`)."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if ep_size == 1:
        return None
    name = expert_group_name(ep_size)
    tagged = [param for chunk in chunks for param in chunk.parameters() if is_moe_param(param)]
    if not tagged and any(isinstance(module, MoELayer) for chunk in chunks for module in chunk.modules()):
        raise DsmtError(f"ep={ep_size} but no parameter is marked as an expert (allreduce=False): this megatron-core "
                        "release marks experts differently; dsmt supports megatron-core 0.16")
    # Registered and tagged even when no expert trains: DeepSpeed broadcasts every expert parameter (frozen ones
    # too) over its expert group when it builds the engine
    expert_group = parallel_state.get_expert_model_parallel_group()
    expert_dp_group = parallel_state.get_expert_data_parallel_group()
    groups._EXPERT_PARALLEL_GROUP[name] = expert_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(expert_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = expert_dp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(expert_dp_group)
    for param in tagged:
        param.group_name = name
    # LoRA without the experts targeted: every expert frozen, nothing for DeepSpeed's expert reduction (which
    # asserts that some optimizer group holds experts); the trained parameters are all dense
    trains = any(param.requires_grad for param in tagged)
    _agree_on_experts(trains, ep_size=ep_size)
    return name if trains else None


def _agree_on_experts(trains: bool, *, ep_size: int) -> None:
    """Raise on every rank when experts train on some ranks and not on others: a pipeline stage of dense layers
    only (DeepSeek's first_k_dense_replace, Qwen2-MoE's mlp_only_layers, at a large pp). DeepSpeed's optimizer then
    runs one more model-parallel all-reduce (the experts' gradient norm) on the stages with experts than on the
    others, and the ranks wait on each other for ever."""
    import torch.distributed as dist

    from toolkit import backend as backends

    counts = torch.tensor([int(trains), int(not trains)], device=backends.current().device)
    dist.all_reduce(counts)
    with_experts, without = (int(count) for count in counts.tolist())
    if with_experts and without:
        raise DsmtError(f"parallel.ep={ep_size}: experts train on {with_experts} rank(s) and not on {without} (a "
                        "pipeline stage of dense layers only holds none): DeepSpeed's expert reduction must run on "
                        "every stage alike. Fix: a parallel.pp whose every stage holds an MoE layer, or parallel.ep=1")


@contextlib.contextmanager
def deepspeed_sees_experts(*, num_experts: int):
    """Inside, a new DeepSpeed engine sets `has_moe_layers` (and `num_experts`) as it does for its own MoE modules,
    which switches on its expert-group reduction, partitioning and gradient norm. DeepSpeed finds MoE layers by
    class in `_configure_distributed_model`; megatron's `MoELayer` is not one, so the method is wrapped for the
    duration of `deepspeed.initialize` only."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_distributed_model

    def configure(self, model):
        original(self, model)
        self.has_moe_layers = True
        self.num_experts = [num_experts]

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original


def set_aux_loss_scale(num_microbatches: int, *, device) -> None:
    """The load-balancing gradient each micro-batch injects is scaled by cp / num_microbatches: summed over the
    micro-batches and averaged over DP × CP by DeepSpeed, the step's load-balancing term is the mean over every
    micro-batch of the global batch, as the LM loss is its per-token mean (each CP rank's term is its share of the
    sequence's, hence the cp). megatron's pipeline schedule sets the same scale itself (schedules.py,
    `forward_step_calc_loss`); DeepSpeed's loop does not, so the PP = 1 driver calls this. A one-element tensor,
    as megatron's: the scale is kept and later copied into. On `device`, the loss's: megatron multiplies it with
    the load-balancing loss in backward, and a one-element CPU tensor does not mix with a CUDA one."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    cp_size = parallel_state.get_context_parallel_world_size()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device) * cp_size / num_microbatches)


def aux_loss_value(chunks: list, *, num_microbatches: int, device) -> float:
    """The step's load-balancing loss as it adds to the LM loss (coefficient included), the same on every rank;
    clears megatron's tracker for the next step. 0 when the model has none.

    The tracker holds, per layer, the sum over this rank's micro-batches of the unscaled term of its tokens
    (partial per TP rank under sequence parallelism). Summed over the pipeline stages (each fills its layers) and
    the TP / CP ranks, then averaged over data-parallel ranks and micro-batches, times the coefficient."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    config = chunks[0].config
    tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    coeff = config.moe_aux_loss_coeff or 0.0
    if tracked is None or coeff == 0:
        return 0.0
    values = tracked["values"].detach().to(device=device, dtype=torch.float64, copy=True)
    dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    if tracked.get("reduce_group") is not None:  # megatron's TP × CP group of the token counts
        dist.all_reduce(values, group=tracked["reduce_group"])
    data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=False)
    dist.all_reduce(values, group=data_parallel)
    clear_aux_losses_tracker()
    return coeff * values.sum().item() / (dist.get_world_size(group=data_parallel) * num_microbatches)


def refuse_fp16(chunks: list) -> None:
    """fp16 scales the LM loss dynamically in DeepSpeed; megatron's load-balancing gradient would not follow."""
    if is_moe(chunks) and getattr(chunks[0].config, "fp16", False):
        raise DsmtError("training.precision=fp16 with a mixture-of-experts model: DeepSpeed's dynamic loss scale "
                        "would not apply to megatron's load-balancing gradient; train in bf16 or fp32")
