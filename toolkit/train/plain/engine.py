"""Models without a megatron-core adapter: DeepSpeed ZeRO data parallelism only (tp = pp = 1).

Any HF model whose `model_type` has no adapter (`toolkit.adapters.family.supported_model_types()`), e.g.
ResNetForImageClassification or DistilBertForMaskedLM, trains as the plain HF module wrapped by DeepSpeed: no mpu, so
the whole world is the data-parallel group, and DeepSpeed owns everything (DP reduction, ZeRO 0-3 partitioning,
clipping, optimizer, LR schedule, checkpoints). The loop is DeepSpeed's own: `engine(**batch)` /
`engine.backward(loss)` / `engine.step()`. Inputs: `toolkit.data.tasks.TaskBatches` on `data.path`, or
`toolkit.train.plain.synthetic.PlainBatches` when `data.synthetic: true`.

The loss, by task (`toolkit.data.tasks.task_of`):
  * masked_lm, causal_lm: per token over the GLOBAL batch, HF's own loss function (`ForMaskedLMLoss`,
    `ForCausalLMLoss` of `transformers.loss.loss_utils`) on the model's logits with `num_items_in_batch` = the
    number of labels != -100 in the step's global batch (after HF's shift for causal LM; one small all-reduce per
    step). It is computed here, not by the model, because several MLM heads (BERT, RoBERTa, DistilBERT) ignore
    `num_items_in_batch` and average each micro-batch on its own. Backward runs on `loss * dp` with
    `scale_wrt_gas=False`, so DeepSpeed's DP averaging leaves the gradient of the global per-token mean.
  * sequence / image classification: `out.loss` as the HF model computes it from `labels` (cross entropy, MSE
    when num_labels == 1), the mean over the micro-batch; micro-batches are equal-sized, so DeepSpeed's 1/GA
    scaling and DP averaging make it the mean over the global batch.
The logged loss is that global value (the sum over micro-batches and ranks of each micro-batch's share).

Validation (`PlainEngine.eval_step`, rows from toolkit/train/job/evaluate.py): forward only in eval mode (dropout off,
BatchNorm on its running statistics; train mode restored after), the task's loss SUMMED over every rank's rows and
divided by its units over the whole validation set: per counted token (masked / causal LM, HF's shift for causal
LM), per sample for classification (cross entropy) and regression (num_labels == 1: squared error). Padding rows
(`sample_mask` 0, labels -100) add nothing. Under ZeRO-3 DeepSpeed's forward gathers the partitioned weights.

BatchNorm (ResNet): statistics are computed per rank over the local micro-batch, as in torch DDP without
SyncBatchNorm. `training.sync_batchnorm: true` converts BatchNorm to `torch.nn.SyncBatchNorm` before DeepSpeed
wraps the model; torch (2.13) runs SyncBatchNorm on GPU/XPU only (its forward raises ValueError for CPU tensors),
so dsmt refuses it on the CPU backend (`SyncBatchNormOnCpuError`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from toolkit.data.tasks import task_of
from toolkit.errors import DsmtError
from toolkit.train.engine.hybrid import StepStats
from toolkit.train.engine.trainer import EngineCheckpoints

PLAIN_NOTICE = ("model_type {model_type} has no megatron-core adapter: training with DeepSpeed ZeRO-{stage} "
                "data parallelism only (tp=1, pp=1)")
# Tasks whose loss is per token over the global batch, with the HF loss function computing it.
TOKEN_LOSSES = {"masked_lm": "ForMaskedLMLoss", "causal_lm": "ForCausalLMLoss"}
KEEP_DTYPE = ("labels", "sample_mask")  # floating tensors of a batch not cast to the weights' dtype (`_on_device`)


class SyncBatchNormOnCpuError(DsmtError):
    """training.sync_batchnorm on the CPU backend, where torch's SyncBatchNorm does not run."""


def model_type_of(hf_dir: Path) -> str:
    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        raise DsmtError(f"{config_path} does not exist: an HF model directory needs a config.json")
    model_type = json.loads(config_path.read_text()).get("model_type")
    if not model_type:
        raise DsmtError(f"{config_path} has no model_type: cannot tell which model it is")
    return model_type


def is_plain_model(hf_dir: Path) -> bool:
    """True when config.json's model_type has no megatron-core adapter (it trains with DeepSpeed DP only)."""
    from toolkit.adapters.family import supported_model_types

    return model_type_of(hf_dir) not in supported_model_types()


def plain_notice(*, model_type: str, zero_stage: int) -> str:
    return PLAIN_NOTICE.format(model_type=model_type, stage=zero_stage)


def check_plain_layout(*, tp: int, pp: int, model_type: str | None = None) -> None:
    """Refuse tensor / pipeline parallelism for a model that has no megatron-core adapter."""
    if tp == 1 and pp == 1:
        return
    from toolkit.adapters.family import supported_model_types

    name = model_type if model_type is not None else "of this model"
    raise DsmtError(f"model_type {name} has no megatron-core adapter, so it trains with DeepSpeed data parallelism "
                    f"only: set parallel.tp=1 and parallel.pp=1 (got tp={tp}, pp={pp}); adapters exist for: "
                    f"{', '.join(supported_model_types())}")


def load_plain_model(hf_dir: Path, *, dtype: torch.dtype):
    """The HF model of `hf_dir`, by the class named in config.json's `architectures[0]` (e.g.
    ResNetForImageClassification, BertForMaskedLM), else AutoModelForCausalLM."""
    import transformers

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is not None:
        return model_class.from_pretrained(hf_dir, dtype=dtype, trust_remote_code=False)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, trust_remote_code=False)
    except (ValueError, KeyError) as err:
        raise DsmtError(
            f"{hf_dir}: config.json names architectures={architectures} (model_type {config.get('model_type')!r}); "
            f"transformers {transformers.__version__} has no such class and AutoModelForCausalLM cannot load it "
            f"({err}); save the model with save_pretrained so architectures names its HF class") from err


class PlainEngine(EngineCheckpoints):
    """A DeepSpeed engine around a plain HF module; the world is the data-parallel group. The loss by task: see
    the module docstring. A `Trainer` (toolkit/train/engine/trainer.py) whose checkpoints resume only at the
    layout that wrote them (no layout-free copy: no megatron-core sharding to resume from)."""

    def __init__(self, *, model, ds_config: dict, lr_schedule=None):
        import deepspeed

        self.task = task_of(model.config)
        self.vocab_size = getattr(model.config, "vocab_size", None)
        params = [p for p in model.parameters() if p.requires_grad]
        self._engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config,
                                                     lr_scheduler=lr_schedule)
        self._engine.train()  # from_pretrained returns eval mode: dropout off, BatchNorm on its running statistics

    @property
    def engine(self):
        return self._engine

    def train_step(self, micro_batches: list[dict]) -> StepStats:
        """One optimizer step over this rank's micro-batches."""
        import torch.distributed as dist

        start = time.perf_counter()
        lr = self._engine.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler steps after the update)
        # DeepSpeed's forward neither moves inputs to the engine's device nor casts them (except for fp16):
        # batches go to this rank's GPU here, and floating inputs (pixel_values) match bf16 weights.
        batches = [self._on_device(batch) for batch in micro_batches]
        if self.task in TOKEN_LOSSES:
            loss = self._token_loss_steps(batches)
        else:
            loss = self._mean_loss_steps(batches)
        dist.all_reduce(loss)
        norm = self._engine.get_global_grad_norm()
        return StepStats(loss=loss.item(), grad_norm=None if norm is None else float(norm), lr=float(lr),
                         step_time_s=time.perf_counter() - start)

    def _on_device(self, batch: dict) -> dict:
        """A micro-batch on the engine's device (NCCL and the model take only tensors there), floating inputs
        in the weights' dtype; training and validation alike.

        Not the labels: float labels are regression targets (num_labels == 1), and they stay fp32. HF's head
        computes MSELoss(logits, labels), which promotes bf16 logits against fp32 targets and so takes the loss
        in fp32, as validation's squared error does (`_loss_sum`): bf16 targets would carry 8 bits of mantissa
        (4.1 trains towards 4.09375) and make the training loss another function than the validation loss.
        Nor the sample_mask of validation rows (bookkeeping, not an input)."""
        dtype = next(self._engine.module.parameters()).dtype
        device = self._engine.device
        return {k: (v.to(dtype) if v.is_floating_point() and k not in KEEP_DTYPE else v).to(device)
                for k, v in batch.items()}

    def _mean_loss_steps(self, batches: list[dict]) -> torch.Tensor:
        """HF's mean loss per micro-batch; returns this rank's share of the global mean."""
        import torch.distributed as dist

        losses = []
        for batch in batches:
            out = self._engine(**batch)
            self._engine.backward(out.loss)  # DeepSpeed scales by 1/gradient_accumulation_steps
            self._engine.step()  # steps at the accumulation boundary only
            losses.append(out.loss.detach().float())
        return torch.stack(losses).mean().reshape(1) / dist.get_world_size()

    def _token_loss_steps(self, batches: list[dict]) -> torch.Tensor:
        """HF's token loss with num_items_in_batch = the global batch's label count; returns this rank's share."""
        import torch.distributed as dist
        from transformers.loss import loss_utils

        loss_function = getattr(loss_utils, TOKEN_LOSSES[self.task])
        # 0-dim, on the batches' (the engine's) device: an NCCL group all-reduces only tensors on this rank's GPU.
        num_items = sum(_counted_labels(b["labels"], task=self.task) for b in batches).float()
        dist.all_reduce(num_items)
        total = torch.zeros(1, device=num_items.device)
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = self._engine(**inputs).logits
            loss = loss_function(logits=logits, labels=batch["labels"], vocab_size=self.vocab_size,
                                 num_items_in_batch=num_items.clamp(min=1))
            # DeepSpeed averages gradients over dp ranks and must not divide by its accumulation steps again
            self._engine.backward(loss * dist.get_world_size(), scale_wrt_gas=False)
            self._engine.step()
            total += loss.detach().float()
        return total


    def eval_step(self, micro_batches: list[dict]):
        """(loss sum, units) of the validation rows of every rank (`EvalSums`); see the module docstring.
        Collective: every rank passes the same number of micro-batches."""
        import torch.distributed as dist

        from toolkit.train.engine.hybrid import EvalSums

        sums = torch.zeros(2, dtype=torch.float64)
        device = self._engine.device
        training = self._engine.training
        self._engine.eval()
        try:
            with torch.no_grad():
                for batch in micro_batches:
                    batch = self._on_device(batch)  # as training feeds the model (labels kept fp32)
                    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sample_mask")}
                    logits = self._engine(**inputs).logits.float()
                    loss_sum, units = self._loss_sum(logits, batch)
                    sums += torch.tensor([float(loss_sum), float(units)], dtype=torch.float64)
        finally:
            self._engine.train(training)
        sums = sums.to(device)
        dist.all_reduce(sums)
        loss_sum, units = sums.cpu().tolist()
        return EvalSums(loss_sum=loss_sum, units=int(round(units)))

    def _loss_sum(self, logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The task's loss summed over the micro-batch's counted units, and their number."""
        import torch.nn.functional as F

        labels = batch["labels"]
        if self.task in TOKEN_LOSSES:
            if self.task == "causal_lm":  # HF's shift: token t predicts label t + 1
                logits, labels = logits[:, :-1], labels[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                   reduction="sum")
            return loss, labels.ne(-100).sum()
        mask = batch["sample_mask"].to(logits.dtype)
        config = self._engine.module.config
        problem = getattr(config, "problem_type", None) or (
            "regression" if config.num_labels == 1 else "single_label_classification")
        if problem == "regression":
            losses = (logits.view(labels.shape[0], -1) - labels.float().view(labels.shape[0], -1)).pow(2).sum(-1)
        elif problem == "single_label_classification":
            losses = F.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1), reduction="none")
        else:
            raise DsmtError(f"problem_type {problem!r} of {type(self._engine.module).__name__}: dsmt's validation "
                            "loss covers regression and single-label classification; unset data.validation_path "
                            "and data.validation_fraction, or save the model with problem_type unset")
        return (losses * mask).sum(), mask.sum()


def _counted_labels(labels: torch.Tensor, *, task: str) -> torch.Tensor:
    """Labels that count in HF's loss: != -100, after the causal LM shift (label 0 is never predicted)."""
    counted = labels[:, 1:] if task == "causal_lm" else labels
    return (counted != -100).sum()


def convert_sync_batchnorm(model, *, device: str):
    """BatchNorm -> torch.nn.SyncBatchNorm (statistics over the whole data-parallel world), before DeepSpeed
    wraps the model. Refused on CPU, where torch's SyncBatchNorm raises in forward."""
    if device == "cpu":
        raise SyncBatchNormOnCpuError(
            "training.sync_batchnorm=true with cluster.device=cpu: torch.nn.SyncBatchNorm runs on GPU/XPU only "
            f"(torch {torch.__version__} raises 'SyncBatchNorm expected input tensor to be on GPU' for CPU "
            "tensors); set training.sync_batchnorm: false (BatchNorm statistics per rank, as DDP without "
            "SyncBatchNorm) or train on cuda")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def export_plain(*, engine, out_dir: Path) -> None:
    """Save the trained model with save_pretrained into `out_dir` (replaced if present). Collective: every rank
    calls it; under ZeRO-3 the partitioned parameters are gathered first. Rank 0 writes into a temporary
    sibling and renames it, so `out_dir` is never a half-written model."""
    import torch.distributed as dist

    from toolkit.convert.checkpoint import atomic_output_dir
    from toolkit.adapters.zero3 import zero3_gathered

    with zero3_gathered(engine):
        if dist.get_rank() == 0:
            with atomic_output_dir(Path(out_dir), overwrite=True) as temp_dir:
                engine.module.save_pretrained(temp_dir)
    dist.barrier()
