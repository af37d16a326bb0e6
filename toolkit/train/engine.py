"""DeepSpeed around megatron-core model chunks: who owns what.

  megatron-core  the layers (TP collectives inside them), and with PP > 1 the pipeline schedule: 1F1B, or
                 interleaved 1F1B over virtual stages, which runs forward and backward of every micro-batch.
  DeepSpeed      everything after the gradients exist: data-parallel reduction, ZeRO partitioning of optimizer
                 state (and gradients / parameters at stages 2 / 3), gradient clipping, the optimizer step, the LR
                 schedule, bf16 master weights, monitors and checkpoints.

Two drivers, chosen by the layout:
  * PP > 1 (ZeRO 0/1): megatron's schedule calls `torch.autograd.backward` itself, so DeepSpeed runs with
    `managed_gradient_accumulation: false`; one `engine.step()` after the schedule is the accumulation boundary
    (reduce over DP, clip, step). megatron already divides each micro-batch loss by the number of micro-batches.
  * PP = 1 (ZeRO 0-3): DeepSpeed's own loop, `engine(batch)` / `engine.backward(loss)` / `engine.step()`, because
    ZeRO-2/3 reduce and partition gradients in hooks that only `engine.backward` arms (a megatron schedule with
    PP = 1 is the same loop over micro-batches, so nothing is lost).
ZeRO-2/3 with PP > 1 is refused before launch (`dsmt check`): every micro-batch would add DP traffic.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from toolkit.train.loss import masked_token_loss
from toolkit.train.mpu import MegatronMpu


@dataclasses.dataclass(frozen=True)
class StepStats:
    loss: float
    grad_norm: float | None
    lr: float
    step_time_s: float


def zero3_gathered(engine):
    """Context in which every parameter of `engine.module` is whole on every rank: ZeRO-3 keeps only a partition
    of each parameter per rank, so exports gather them first (a no-op at lower stages)."""
    import contextlib

    import deepspeed

    if engine.zero_optimization_stage() < 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def engine_config(ds_config: dict, *, pp_size: int) -> dict:
    """The generated DeepSpeed config, adjusted for the driver the layout uses."""
    config = {**ds_config, "zero_optimization": dict(ds_config.get("zero_optimization", {}))}
    if pp_size > 1:
        config["managed_gradient_accumulation"] = False
        config["zero_optimization"]["overlap_comm"] = False  # DeepSpeed allows overlap here only at ZeRO-2
    return config


class HybridEngine:
    def __init__(self, *, chunks: list, ds_config: dict, vocab_size: int, tied_embeddings: bool, pp_size: int):
        import deepspeed

        module = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        params = [p for p in module.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params,
                                                    config=engine_config(ds_config, pp_size=pp_size), mpu=MegatronMpu())
        self.vocab_size = vocab_size
        self.pp_size = pp_size
        self.tied_embeddings = tied_embeddings

    @property
    def chunks(self) -> list:
        module = self.engine.module
        return list(module) if isinstance(module, torch.nn.ModuleList) else [module]

    def train_step(self, micro_batches: list[dict]) -> StepStats:
        start = time.perf_counter()
        lr = self.engine.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler steps after the update)
        local_loss = self._pipeline_step(micro_batches) if self.pp_size > 1 else self._deepspeed_step(micro_batches)
        norm = self.engine.get_global_grad_norm()
        return StepStats(loss=self._global_mean_loss(local_loss), grad_norm=None if norm is None else float(norm),
                         lr=float(lr), step_time_s=time.perf_counter() - start)

    def _deepspeed_step(self, micro_batches: list[dict]) -> torch.Tensor:
        losses = []
        for batch in micro_batches:
            logits = self.engine(batch["tokens"], batch["position_ids"], None)
            loss = masked_token_loss(logits, labels=batch["labels"], loss_mask=batch["loss_mask"], vocab_size=self.vocab_size)
            self.engine.backward(loss)
            self.engine.step()  # steps at the accumulation boundary only
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _pipeline_step(self, micro_batches: list[dict]) -> torch.Tensor:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        losses: list[torch.Tensor] = []

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            logits = model(batch["tokens"], batch["position_ids"], None)

            def loss_func(output):
                loss = masked_token_loss(output, labels=batch["labels"], loss_mask=batch["loss_mask"],
                                         vocab_size=self.vocab_size)
                losses.append(loss.detach().clone())  # the schedule divides the returned loss in place
                return loss, {}

            return logits, loss_func

        chunks = self.chunks
        iterators = [iter(micro_batches) for _ in chunks]
        first = micro_batches[0]["tokens"]
        self.engine.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micro_batches),
            seq_length=first.shape[1], micro_batch_size=first.shape[0], forward_only=False,
        )
        self._allreduce_tied_embedding_grads()
        self.engine.step()  # unmanaged accumulation: this call reduces over DP, clips and steps
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def _allreduce_tied_embedding_grads(self) -> None:
        """With tied embeddings and PP > 1 the first and last stages each hold a copy of the embedding; summing
        their gradients over megatron's embedding group keeps the copies identical after every step."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not self.tied_embeddings or self.pp_size == 1 or not parallel_state.is_rank_in_embedding_group():
            return
        for chunk in self.chunks:
            if chunk.pre_process or chunk.post_process:
                weight = chunk.shared_embedding_or_output_weight()
                if weight is not None and weight.grad is not None:
                    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _global_mean_loss(self, local_loss: torch.Tensor) -> float:
        """The step's loss on every rank: from the last pipeline stage, averaged over data-parallel ranks."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        value = local_loss.detach().float().reshape(1).clone()
        if not parallel_state.is_pipeline_last_stage():
            value.zero_()
        dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
        return value.item() / parallel_state.get_data_parallel_world_size()
