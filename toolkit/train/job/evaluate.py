"""Validation loss during training: which rows each data-parallel rank evaluates, and the evaluation itself.

The validation examples (toolkit/data/validation.py) are dealt round robin over the data-parallel ranks: rank `r`
takes rows `r, r + dp, r + 2·dp, ...`, in micro-batches of `micro_batch_size`. Every rank runs the same number of
micro-batches, `ceil(ceil(N / dp) / micro_batch_size)` (rounded up to a multiple of pp with virtual pipeline
stages, which megatron's interleaved schedule wants): the short ranks are padded with copies of row 0 whose
loss_mask is 0, so they add nothing. The ranks of one replica (TP / PP / CP) take the same rows.

    val_loss = sum of the token losses over the whole validation set / number of counted tokens

(per masked token for masked LM, per sample for classification / regression), forward only with dropout off:
independent of the layout, the micro-batch size and the packing of the rows, and comparable across runs that share
the validation data.

Two kinds of rows: megatron-core causal LMs read dsmt's cached token rows (`Validation`); the encoder heads of the
hybrid engine and the plain engine's HF models (toolkit/train/plain/engine.py) read the task's HF keyword rows of
toolkit/data/tasks.py (`TaskValidation`: masked-LM masks seeded by the validation row index), whose padding rows
carry labels -100 (token tasks) and `sample_mask` 0 (every task; the per-sample losses read it).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from toolkit.errors import DsmtError
from toolkit.train.job.eval_rows import preference_rows, rank_rows  # noqa: F401  (rank_rows: part of this API)


@dataclasses.dataclass(frozen=True)
class ValLoss:
    loss: float  # per counted token over the whole validation set (per pair for DPO)
    units: int  # the counted tokens (samples for classification, pairs for DPO)
    eval_time_s: float
    metrics: dict[str, float] | None = None  # the task's other means over the same units (DPO: rewards/*, logps/*)


class Validation:
    """The validation micro-batches of one rank, gathered in the training batches' format (`MicroBatches`), so
    whatever the rows carry (positions of packed records) reaches the model as in training."""

    def __init__(self, *, examples, micro_batch_size: int, dp_rank: int, dp_size: int, microbatch_multiple: int = 1,
                 reference=None):
        from toolkit.data.batches import MicroBatches

        self.examples = examples
        self.num_examples = len(examples)
        self.counted_tokens = examples.counted_tokens()
        self.preference = getattr(examples, "kind", None) == "preference"
        self.unit_name = "counted tokens"
        if self.preference:  # DPO: the loss and its metrics are per pair
            self.counted_tokens, self.unit_name = self.num_examples, "pairs"
        self.reference = reference  # precomputed reference log-probs (toolkit/train/engine/preference.py)
        self._gatherer = MicroBatches(examples=examples, micro_batch_size=micro_batch_size, num_microbatches=1,
                                      dp_rank=dp_rank, dp_size=dp_size, seed=0, shuffle=False)
        self.rows = rank_rows(num_examples=self.num_examples, dp_rank=dp_rank, dp_size=dp_size,
                              micro_batch_size=micro_batch_size, microbatch_multiple=microbatch_multiple)

    def micro_batches(self) -> list[dict[str, torch.Tensor]]:
        batches = [self._gather(rows) for rows in self.rows]
        return [self.reference.add(batch) for batch in batches] if self.reference is not None else batches

    def _gather(self, rows: list[int | None]) -> dict[str, torch.Tensor]:
        if self.preference:
            return preference_rows(self.examples, rows)
        batch = self._gatherer._gather(torch.tensor([0 if row is None else row for row in rows]))
        padding = torch.tensor([row is None for row in rows])
        if padding.any():
            batch["loss_mask"] = batch["loss_mask"].masked_fill(padding[:, None], 0.0)
        return batch


class TaskValidation:
    """The validation micro-batches of one rank as the task's HF keyword inputs (toolkit/data/tasks.py); the same
    interface as `Validation`. Validation row v is masked (masked LM) with `mlm_row_seed(seed, v)`."""

    def __init__(self, *, examples, micro_batch_size: int, dp_rank: int, dp_size: int, microbatch_multiple: int = 1):
        self.examples = examples
        self.num_examples = len(examples)
        self.rows = rank_rows(num_examples=self.num_examples, dp_rank=dp_rank, dp_size=dp_size,
                              micro_batch_size=micro_batch_size, microbatch_multiple=microbatch_multiple)
        self.counted_tokens = self._count_units()
        self.unit_name = {"masked_lm": "masked tokens", "causal_lm": "counted tokens"}.get(examples.task, "samples")

    def micro_batches(self) -> list[dict[str, torch.Tensor]]:
        return [self._gather(rows) for rows in self.rows]

    def _gather(self, rows: list[int | None]) -> dict[str, torch.Tensor]:
        indices = torch.tensor([0 if row is None else row for row in rows])
        batch = self.examples.batch(indices=indices, positions=indices)  # positions: the validation row index
        counted = torch.tensor([row is not None for row in rows])
        if batch["labels"].dim() > 1:  # token labels: padding rows count no token
            batch["labels"] = batch["labels"].masked_fill(~counted[:, None], -100)
        batch["sample_mask"] = counted.float()
        return batch

    def _count_units(self) -> int:
        """Masked (MLM) or labelled-after-the-shift (causal LM) tokens of the whole set; else its samples."""
        task = self.examples.task
        if task not in ("masked_lm", "causal_lm"):
            return self.num_examples
        total = 0
        for start in range(0, self.num_examples, 256):
            indices = torch.arange(start, min(start + 256, self.num_examples))
            labels = self.examples.batch(indices=indices, positions=indices)["labels"]
            total += int((labels[:, 1:] if task == "causal_lm" else labels).ne(-100).sum().item())
        return total


def evaluate(*, trainer, validation: Validation) -> ValLoss:
    """The validation loss of the trainer's current weights (collective: every rank calls it)."""
    start = time.perf_counter()
    sums = trainer.eval_step(validation.micro_batches())
    return ValLoss(loss=sums.loss, units=sums.units, eval_time_s=time.perf_counter() - start,
                   metrics=getattr(sums, "metrics", None))


def build_validation(*, spec, layout, trainer, hf_dir) -> Validation | TaskValidation | None:
    """The run's validation micro-batches, or None when the spec asks for none: dsmt's cached token rows for a
    megatron-core causal LM (collective: rank 0 tokenises into the data cache), the task's HF keyword rows for the
    encoder heads and the plain engine (every rank reads them, like its training rows). Refuses a trainer that
    has no `eval_step`, by name."""
    from megatron.core import parallel_state

    from toolkit.data.training import job_rows
    from toolkit.data.validation import VALIDATION, describe_source, has_validation
    from toolkit.spec.preference import PREFERENCE_METHODS

    data = spec.data
    if not has_validation(data):
        return None
    task = getattr(trainer, "task", None)
    if not callable(getattr(trainer, "eval_step", None)):
        what = getattr(task, "name", task) or type(trainer).__name__
        raise DsmtError(f"validation_unsupported: {describe_source(data)} asks for a validation loss, but this run "
                        f"trains {what} with {type(trainer).__name__}, which has no eval_step(); unset "
                        "data.validation_path and data.validation_fraction")
    interleaved = len(getattr(trainer, "chunks", [None])) > 1
    rows = dict(micro_batch_size=layout.micro_batch_size, dp_rank=parallel_state.get_data_parallel_rank(),
                dp_size=layout.dp, microbatch_multiple=layout.pp if interleaved else 1)
    # the encoder heads (hybrid) and every plain model's task read HF keyword rows; causal LMs dsmt's cached rows
    if getattr(task, "name", None) not in ("causal_lm", *PREFERENCE_METHODS):
        return TaskValidation(examples=task_validation_examples(spec=spec, layout=layout, hf_dir=hf_dir), **rows)
    examples = job_rows(data=data, model_path=str(hf_dir), seq_length=layout.seq_length, vocab_size=task.vocab_size,
                        seed=spec.training.seed, output_dir=spec.training.output_dir, part=VALIDATION)
    from toolkit.train.job.preference_run import precomputed_reference

    # before training starts (`build_validation` runs before the resume): the policy is still the reference
    return Validation(examples=examples, reference=precomputed_reference(spec=spec, layout=layout, hybrid=trainer,
                                                                         examples=examples, hf_dir=hf_dir), **rows)


def task_validation_examples(*, spec, layout, hf_dir):
    """The validation records read for the task of the checkpoint's head (toolkit/data/tasks.py)."""
    from transformers import AutoConfig

    from toolkit.data.tasks import task_examples
    from toolkit.data.validation import VALIDATION, ValidationDataError

    if spec.data.synthetic:
        raise ValidationDataError("data.synthetic=true has no validation records; unset data.validation_path and "
                                  "data.validation_fraction, or train on data.path")
    return task_examples(data=spec.data, model_config=AutoConfig.from_pretrained(hf_dir, trust_remote_code=False),
                         tokenizer_path=str(hf_dir), seq_length=layout.seq_length, seed=spec.training.seed,
                         part=VALIDATION)


def eval_steps(*, eval_interval: int | None, start: int, total: int) -> list[int]:
    """The steps after which the validation loss is measured: 0 (before the first step, unless the run resumes
    after it), every eval_interval, and the last."""
    steps = {total}
    if eval_interval is not None:
        steps.update(range(eval_interval, total + 1, eval_interval))
    steps.add(0)
    return sorted(step for step in steps if step > start or step == start == 0)
