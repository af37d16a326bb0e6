"""DeepSpeed around megatron-core model chunks: who owns what.

  megatron-core  the layers (TP collectives inside them), and with PP > 1 the pipeline schedule: 1F1B, or
                 interleaved 1F1B over virtual stages, which runs forward and backward of every micro-batch.
  DeepSpeed      everything after the gradients exist: data-parallel reduction, ZeRO partitioning of optimizer
                 state (and gradients / parameters at stages 2 / 3), gradient clipping, the optimizer step, the LR
                 schedule, bf16 master weights, monitors and checkpoints.

Two drivers, chosen by the layout:
  * PP > 1 (ZeRO 0/1): megatron's schedule calls `torch.autograd.backward` itself, so DeepSpeed runs with
    `managed_gradient_accumulation: false`; one `engine.step()` after the schedule is the accumulation boundary
    (reduce over DP, clip, step). Needs DeepSpeed >= 0.19.4; `check_driver` refuses an engine that still manages
    accumulation.
  * PP = 1 (ZeRO 0-3): DeepSpeed's own loop, `engine(batch)` / `engine.backward(loss)` / `engine.step()`, because
    ZeRO-2/3 reduce and partition gradients in hooks that only `engine.backward` arms (a megatron schedule with
    PP = 1 is the same loop over micro-batches, so nothing is lost).
ZeRO-2/3 with PP > 1 is refused before launch (`dsmt check`): every micro-batch would add DP traffic.
With sequence parallelism the norms' gradients are partial per TP rank; a hook per such parameter sums them over
the TP group as each is computed, before DeepSpeed sees them (`sum_sequence_parallel_grads`), in both drivers.
Mixture of experts (details: `toolkit/train/engine/moe.py`): megatron-core routes tokens, dispatches them over the EP
group, runs the experts and injects the load-balancing gradient; DeepSpeed reduces expert gradients over the
expert-data-parallel group and partitions their ZeRO states there (dense ones over the whole DP group), once dsmt
has registered megatron's expert groups with it; dsmt scales the load-balancing gradient like the loss and adds
its value to the logged loss.
Both drivers backpropagate the same loss per unit (token, or sample for classification) over the global batch
(`HybridEngine`), the model call and the loss coming from the task (`toolkit/train/engine/tasks.py`: causal LM, masked
LM, sequence classification / regression); bf16 accumulates and reduces gradients in fp32
(`toolkit/generate/deepspeed_config.py`).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext

import torch

from toolkit import backend as backends
from toolkit.adapters.load import full_shape
from toolkit.errors import DsmtError
from toolkit.train.engine import moe, step_inputs
from toolkit.parallel.mpu import MegatronMpu
from toolkit.train.engine.tasks import CausalLM
from toolkit.train.engine.tp_grads import sum_sequence_parallel_grads
from toolkit.train.engine.trainer import EngineCheckpoints

MIN_DEEPSPEED = "0.19.4"  # the first release with `managed_gradient_accumulation` (the PP > 1 driver needs it)


@dataclasses.dataclass(frozen=True)
class StepStats:
    loss: float
    grad_norm: float | None
    lr: float
    step_time_s: float
    tokens: int | None = None  # loss units of the global batch (counted tokens; samples for classification; pairs)
    metrics: dict[str, float] | None = None  # the task's other means per unit (DPO: TRL's rewards/*, logps/*)


@dataclasses.dataclass(frozen=True)
class EvalSums:
    """A forward-only pass over every rank's micro-batches: loss summed over all of them, and the loss units
    (counted tokens; samples for classification) that sum is over. The same on every rank."""

    loss_sum: float
    units: int
    metric_sums: dict[str, float] | None = None  # the task's other sums over the same units (DPO)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.units, 1)

    @property
    def metrics(self) -> dict[str, float] | None:
        if self.metric_sums is None:
            return None
        return {name: value / max(self.units, 1) for name, value in self.metric_sums.items()}


def engine_config(ds_config: dict, *, pp_size: int) -> dict:
    """The generated DeepSpeed config, adjusted for the driver the layout uses."""
    config = {**ds_config, "zero_optimization": dict(ds_config.get("zero_optimization", {}))}
    if pp_size > 1:
        config["managed_gradient_accumulation"] = False
        config["zero_optimization"]["overlap_comm"] = False  # DeepSpeed allows overlap here only at ZeRO-2
    return config


class HybridEngine(EngineCheckpoints):
    """One rank's DeepSpeed engine around its megatron-core chunks, and the training step of both drivers.

    The loss of a step is per token over the GLOBAL batch: the sum of the token losses of every micro-batch on
    every data-parallel rank divided by the step's number of loss tokens (HF's `num_items_in_batch`). Each
    micro-batch therefore backpropagates `sum(token losses) * dp / global_tokens`; DeepSpeed's data-parallel mean
    divides by dp again, so the summed gradient is d(sum over the global batch)/global_tokens whatever the split
    into TP / PP / DP ranks and micro-batches. `task` (toolkit/train/engine/tasks.py) says what a unit is (a counted
    token; a sample for classification), how the model is called and the loss summed; default: causal LM.
    A `Trainer` (toolkit/train/engine/trainer.py); its checkpoints carry the layout-free copy (`layout_free`)."""

    engine: object  # DeepSpeed's engine around the chunks (set by `deepspeed.initialize`)

    def __init__(self, *, chunks: list, ds_config: dict, vocab_size: int, tied_embeddings: bool, pp_size: int,
                 task=None, lr_schedule=None, reference=None):
        import deepspeed

        module = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        if tied_embeddings and pp_size > 1:
            mark_tied_output_copies(chunks)
        config = engine_config(ds_config, pp_size=pp_size)
        groups = weight_decay_groups(module, weight_decay=config["optimizer"]["params"]["weight_decay"])
        moe.refuse_fp16(chunks)
        experts = moe.register_expert_groups(chunks)
        scope = moe.deepspeed_sees_experts(num_experts=chunks[0].config.num_moe_experts) if experts else nullcontext()
        with scope:
            self.engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=groups, config=config,
                                                        mpu=MegatronMpu(), lr_scheduler=lr_schedule)
        self.is_moe = moe.is_moe(chunks)
        check_driver(self.engine, pp_size=pp_size)
        self._sequence_parallel_hooks = sum_sequence_parallel_grads(self.chunks)
        self.task = task if task is not None else CausalLM(vocab_size=vocab_size)
        self.pp_size = pp_size
        self.tied_embeddings = tied_embeddings
        # DPO's live reference (toolkit/train/engine/preference.py `LiveReference`): its log-probs join each
        # micro-batch before the policy's forward; None when the batches bring them (precomputed) or there is no DPO
        self.reference = reference

    @property
    def chunks(self) -> list:
        module = self.engine.module
        return list(module) if isinstance(module, torch.nn.ModuleList) else [module]

    def layout_free(self, layout):
        """The chunks' weights and optimizer state in megatron-core's sharded form, which any layout loads
        (toolkit/train/checkpoint/reshard.py)."""
        from toolkit.train.checkpoint.reshard import LayoutFreeState

        return LayoutFreeState(engine=self.engine, chunks=self.chunks, layout=layout.record,
                               global_batch_size=layout.global_batch_size)

    def train_step(self, micro_batches: list[dict]) -> StepStats:
        """One optimizer step over this rank's micro-batches. Nothing is read back from the device until the
        optimizer step is queued (toolkit/train/engine/step_inputs.py): what the host must know of the batches is
        read before they are copied, the loss's per-unit scale stays on the device, and the step's values come
        back together at its end (`_step_stats`)."""
        start = time.perf_counter()
        lr = self.engine.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler steps after the update)
        device = backends.current().device
        micro_batches = step_inputs.on_device(micro_batches, count=self.task.count)
        if self.reference is not None:
            self.reference.add_logps(self, micro_batches)  # before the CP cut: the reference cuts its own copy
        micro_batches = step_inputs.context_parallel_slices(micro_batches)
        step_inputs.check_sequence_split(seq_length=self.task.sequence(micro_batches[0]).shape[1], chunks=self.chunks)
        global_units = step_inputs.global_units(micro_batches, device=device)
        self._prepare_step(micro_batches, global_units=global_units)
        # dp / global units: see the class docstring (clamped: a step whose tokens are all masked learns nothing)
        scale = step_inputs.loss_scale(global_units, dp_size=MegatronMpu().get_data_parallel_world_size())
        step = self._pipeline_step if self.pp_size > 1 else self._deepspeed_step
        if self.is_moe and self.pp_size == 1:
            moe.set_aux_loss_scale(len(micro_batches), device=device)  # megatron's pipeline schedule sets its own
        local_sums = step(micro_batches, scale=scale)
        return self._step_stats(local_sums, global_units=global_units, lr=lr, start=start,
                                num_microbatches=len(micro_batches))

    def _step_stats(self, local_sums: torch.Tensor, *, global_units: torch.Tensor, lr: float, start: float,
                    num_microbatches: int) -> StepStats:
        """The step's values on the host, read once, after its optimizer step: the loss and metric sums (last
        stage, every replica), the global units, the gradient norm, MoE's load-balancing loss."""
        device = backends.current().device
        norm = self.engine.get_global_grad_norm()
        aux = moe.aux_loss_value(self.chunks, num_microbatches=num_microbatches, device=device) if self.is_moe else 0.0
        summed = self._reduce_last_stage(local_sums.detach().double())
        values = torch.cat([summed, global_units.to(summed.device, torch.float64)]).tolist()
        sums, global_count = values[:-1], int(values[-1])
        units = max(global_count, 1)
        return StepStats(loss=sums[0] / units + aux, grad_norm=None if norm is None else float(norm), lr=float(lr),
                         step_time_s=time.perf_counter() - start, tokens=global_count,
                         metrics=self._metric_values(sums[1:], units=units))

    def _prepare_step(self, micro_batches: list[dict], *, global_units: torch.Tensor) -> None:
        """A task's per-step constants over the global batch (ORPO: its chosen tokens), set into each micro-batch.
        Collective over the data-parallel group, on every rank. `global_units`: int64 [1] where the batches are."""
        prepare = getattr(self.task, "prepare_step", None)
        if prepare is None:
            return

        def reduce(value: torch.Tensor) -> torch.Tensor:  # on the device (NCCL), back where it was
            import torch.distributed as dist

            summed = value.to(backends.current().device)
            dist.all_reduce(summed, group=MegatronMpu().get_data_parallel_group())
            return summed.to(value.device)

        prepare(micro_batches, global_units=global_units, reduce=reduce)

    def _metric_values(self, sums: list[float], *, units: int) -> dict[str, float] | None:
        names = getattr(self.task, "metric_names", ())
        return {name: value / units for name, value in zip(names, sums)} if names else None

    def _loss_terms(self, output, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum with its graph, the detached 1-D sums this engine adds up and reduces: the loss sum, then the
        task's metric sums). A task with metrics (DPO) gives them with its loss (`loss_terms`)."""
        terms = getattr(self.task, "loss_terms", None)
        if terms is None:
            loss = self.task.loss_sum(output, batch)
            return loss, loss.detach().float().reshape(1)
        loss, metrics = terms(output, batch)
        return loss, torch.cat([loss.detach().float().reshape(1), metrics.float()])

    def eval_step(self, micro_batches: list[dict]) -> EvalSums:
        """Forward only, no gradient, dropout off (eval mode, restored after): the task's loss summed over this
        rank's micro-batches and every data-parallel rank's. Collective over the model- and data-parallel groups:
        every rank passes the same number of micro-batches (zero-loss rows pad the short ones,
        toolkit/train/job/evaluate.py). Micro-batches move to the device one at a time."""
        if not micro_batches:
            raise DsmtError("eval_step() got no micro-batches: every rank needs at least one (pad with loss 0 rows)")
        collected: list[torch.Tensor] = []  # per micro-batch on the last stage: loss sum, metric sums, units
        if self.reference is not None or hasattr(self.task, "prepare_step"):  # the caller's stay as they were
            micro_batches = [dict(batch) for batch in micro_batches]
        if self.reference is not None:
            self.reference.add_logps(self, micro_batches)
        if hasattr(self.task, "prepare_step"):  # over the whole evaluation: every rank's micro-batches
            device = backends.current().device
            units = step_inputs.global_loss_tokens(micro_batches, device=device, count=self.task.count)
            self._prepare_step(micro_batches, global_units=torch.tensor([units]))  # host batches: a host tensor

        def add_sums(output, batch: dict) -> None:
            _, sums = self._loss_terms(output, batch)
            collected.append(torch.cat([sums.double().cpu(), torch.tensor([float(self.task.count(batch))],
                                                                           dtype=torch.float64)]))

        self.forward_only(micro_batches, on_output=add_sums)
        width = 2 + len(getattr(self.task, "metric_names", ()))
        local = torch.stack(collected).sum(0) if collected else torch.zeros(width, dtype=torch.float64)
        sums = self._reduce_last_stage(local).tolist()
        names = getattr(self.task, "metric_names", ())
        return EvalSums(loss_sum=sums[0], units=int(round(sums[-1])),
                        metric_sums=dict(zip(names, sums[1:-1])) if names else None)

    def forward_only(self, micro_batches: list[dict], *, on_output, chunks: list | None = None) -> None:
        """Forward passes without gradient in eval mode (dropout off; restored after) over `chunks` (default: the
        trained ones, through DeepSpeed's engine, which ZeRO-3 needs to gather them; a frozen reference's own);
        `on_output(output, batch)` runs on the last pipeline stage for each micro-batch, in micro-batch order.
        Collective over the model-parallel groups; micro-batches move to the device one at a time."""
        own = chunks is None
        modules = [self.engine] if own else list(chunks)
        training = [module.training for module in modules]
        for module in modules:
            module.eval()
        try:
            with torch.no_grad():
                if self.pp_size > 1:
                    self._pipeline_forward(micro_batches, on_output=on_output, chunks=chunks)
                else:
                    for batch in self._eval_inputs(micro_batches):
                        on_output(self.task.forward(modules[0], batch), batch)
        finally:
            for module, was in zip(modules, training):
                module.train(was)

    def _eval_inputs(self, micro_batches: list[dict]):
        for index, batch in enumerate(micro_batches):
            (batch,) = step_inputs.context_parallel_slices(step_inputs.on_device([batch], count=None))
            if index == 0:
                step_inputs.check_sequence_split(seq_length=self.task.sequence(batch).shape[1], chunks=self.chunks)
            yield batch

    def _pipeline_forward(self, micro_batches: list[dict], *, on_output, chunks: list | None) -> None:
        """megatron's schedule with forward_only=True; the loss function runs on the last stage only."""
        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = self.task.forward(model, batch)

            def loss_func(out):
                on_output(out, batch)
                # a new tensor: megatron divides the returned loss in place by the number of micro-batches
                return torch.zeros((), device=out.device), {}

            return output, loss_func

        first = self.task.sequence(micro_batches[0])
        # the full length (these are the micro-batches before the CP cut): megatron divides it for the p2p tensors
        self._run_schedule(forward_step, iterators=lambda: self._eval_inputs(micro_batches),
                           num_microbatches=len(micro_batches), seq_length=first.shape[1],
                           micro_batch_size=first.shape[0], forward_only=True, chunks=chunks)

    def _run_schedule(self, forward_step, *, iterators, num_microbatches: int, seq_length: int,
                      micro_batch_size: int, forward_only: bool, chunks: list | None = None) -> None:
        """megatron's pipeline schedule over this rank's chunks (one data iterator per virtual stage, made by
        `iterators()`); the interleaved schedule takes lists, the plain 1F1B one a single model and iterator."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = self.chunks if chunks is None else chunks
        data = [iterators() for _ in chunks]
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only,
        )

    def _deepspeed_step(self, micro_batches: list[dict], *, scale: torch.Tensor) -> torch.Tensor:
        sums = []
        for batch in micro_batches:
            token_sum, batch_sums = self._loss_terms(self.task.forward(self.engine, batch), batch)
            # The scale already accounts for accumulation: DeepSpeed must not divide by its GAS again.
            self.engine.backward(token_sum * scale.to(token_sum.dtype), scale_wrt_gas=False)
            self.engine.step()  # steps at the accumulation boundary only
            sums.append(batch_sums)
        return torch.stack(sums).sum(0)

    def _pipeline_step(self, micro_batches: list[dict], *, scale: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        sums: list[torch.Tensor] = []
        num_microbatches = len(micro_batches)
        cp_size = parallel_state.get_context_parallel_world_size()

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            logits = self.task.forward(model, batch)

            def loss_func(output):
                token_sum, batch_sums = self._loss_terms(output, batch)
                sums.append(batch_sums)
                # megatron's schedule divides a (loss, {}) return by num_microbatches and multiplies it by the CP
                # size: undo both so that the backpropagated value is token_sum * scale, as in the DeepSpeed driver.
                return token_sum * (scale * num_microbatches / cp_size).to(token_sum.dtype), {}

            return logits, loss_func

        first = self.task.sequence(micro_batches[0])
        self.engine.zero_grad()
        # the full length: megatron divides it by cp (and by tp under SP) for the p2p tensors
        self._run_schedule(forward_step, iterators=lambda: iter(micro_batches), num_microbatches=num_microbatches,
                           seq_length=first.shape[1] * cp_size, micro_batch_size=first.shape[0], forward_only=False)
        self._allreduce_tied_embedding_grads()
        # DeepSpeed counts samples by its backward calls, which megatron's schedule bypasses; without this its
        # CSV / TensorBoard monitors plot every PP > 1 step at x = 0 samples.
        self.engine._unmanaged_backward_count = num_microbatches
        self.engine.step()  # unmanaged accumulation: this call reduces over DP, clips and steps
        width = 1 + len(getattr(self.task, "metric_names", ()))
        return torch.stack(sums).sum(0) if sums else torch.zeros(width, device=first.device)

    def _allreduce_tied_embedding_grads(self) -> None:
        """With tied embeddings and PP > 1 the first and last stages each hold a copy of the embedding; summing
        their gradients over megatron's embedding group keeps the copies identical after every step. A frozen
        embedding (LoRA) has no gradient and nothing to keep equal; every rank of the group agrees on that."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not self.tied_embeddings or self.pp_size == 1 or not parallel_state.is_rank_in_embedding_group():
            return
        for chunk in self.chunks:
            if chunk.pre_process or chunk.post_process:
                weight = chunk.shared_embedding_or_output_weight()
                if weight is not None and weight.requires_grad:
                    dist.all_reduce(accumulated_grad(weight), group=parallel_state.get_embedding_group())

    @staticmethod
    def _reduce_last_stage(local: torch.Tensor) -> torch.Tensor:
        """`local` (1-D) of the last pipeline stage summed over the data-parallel ranks (and the CP ranks'
        slices), on every rank; on the device (the caller reads it back)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        value = local.to(backends.current().device, copy=True)
        if not parallel_state.is_pipeline_last_stage():
            value.zero_()
        dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(value, group=MegatronMpu().get_data_parallel_group())  # the CP ranks' slices too
        return value


def accumulated_grad(param: torch.Tensor) -> torch.Tensor:
    """The tensor holding `param`'s accumulated gradient: `param.grad`, or under bf16 with fp32 accumulation the
    fp32 buffer DeepSpeed's BF16_Optimizer moved it into (`immediate_grad_update` frees the bf16 gradient)."""
    if param.grad is not None:
        return param.grad
    hp_grad = getattr(param, "_hp_grad", None)
    if hp_grad is None:
        raise DsmtError("a tied embedding copy has no gradient after the pipeline schedule (neither param.grad nor "
                        "DeepSpeed's fp32 accumulation buffer): the two copies would drift apart; this DeepSpeed "
                        "release keeps gradients elsewhere, please report it with `pip show deepspeed`")
    return hp_grad


def mark_tied_output_copies(chunks: list) -> None:
    """The last stage's copy of a tied embedding gets the gradient of the same parameter as the first stage's;
    DeepSpeed skips parameters marked `ds_pipe_replicated` in the gradient norm, so the tied weight counts once."""
    for chunk in chunks:
        if chunk.post_process and not chunk.pre_process:
            chunk.output_layer.weight.ds_pipe_replicated = True


def weight_decay_groups(module: torch.nn.Module, *, weight_decay: float) -> list[dict]:
    """megatron's convention: no weight decay on biases and norm weights (every 1-D parameter). Under ZeRO-3 a
    partitioned parameter is a flat 1-D shard; its full shape is `ds_shape`."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (no_decay if len(full_shape(param)) == 1 else decay).append(param)
    # Named: with expert parallelism DeepSpeed splits each group per expert group and names the parts after it.
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [group for group in groups if group["params"]]


def check_driver(engine, *, pp_size: int) -> None:
    """At PP > 1 megatron's schedule runs backward itself and one `engine.step()` must be the accumulation
    boundary; a DeepSpeed without `managed_gradient_accumulation` ignores the key, steps every GAS calls and never
    reduces over DP, and the replicas drift apart silently."""
    if pp_size == 1:
        return
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is None or managed() or not hasattr(engine, "_unmanaged_backward_count"):
        import deepspeed

        raise DsmtError(f"pipeline parallelism (pp={pp_size}) needs DeepSpeed >= {MIN_DEEPSPEED} "
                        f"(managed_gradient_accumulation: false); this is DeepSpeed {deepspeed.__version__}: "
                        f"pip install 'deepspeed>={MIN_DEEPSPEED},<0.20'")
