"""Stop a run whose loss or gradient norm is no longer a number, before its state is saved or exported.

bf16 and fp32 have no loss scale: a non-finite loss or gradient norm means the weights or the optimizer state are
(or are about to be) NaN / inf, and DeepSpeed only skips the update; every later checkpoint and the export would
hold the damage. fp16 is different: DeepSpeed's dynamic loss scale overflows by design, skips that step and lowers
the scale; only a run of `training.max_skipped_steps` skips in a row (a scale that cannot recover) stops it."""

from __future__ import annotations

import math

from toolkit.errors import DsmtError


class TrainingDiverged(DsmtError):
    """Rule `non_finite_loss` / `too_many_skipped_steps`; exit code 3 (not a bad input: a run that went wrong)."""

    exit_code = 3


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


class StepGuard:
    """Check each step's result on every rank; raises the same TrainingDiverged on every rank (the decision is
    all-reduced, so no rank goes on into a collective the others left)."""

    def __init__(self, *, precision: str, max_skipped_steps: int, last_checkpoint: str | None, engine):
        self.precision, self.max_skipped_steps = precision, max_skipped_steps
        self.last_checkpoint = last_checkpoint
        self.skipped_in_a_row = 0
        self._skipped_total = int(getattr(engine, "skipped_steps", 0))  # DeepSpeed's count (a resume loads it)

    def saved(self, tag: str) -> None:
        self.last_checkpoint = tag

    def check(self, *, step: int, stats, engine) -> None:
        bad = not (finite(stats.loss) and finite(stats.grad_norm))
        if self.precision == "fp16":
            self._count_skips(step=step, engine=engine, stats=stats)
        elif _any_rank(bad):
            norm = "n/a" if stats.grad_norm is None else f"{stats.grad_norm}"
            raise TrainingDiverged(
                f"[non_finite_loss] step {step}: loss {stats.loss}, grad norm {norm} ({self.precision}); the run "
                f"stopped before saving or exporting anything from this step on; {self._resume_from()}\n"
                "fix: lower training.lr, set training.grad_clip (e.g. 1.0), add warmup_steps, or check the data "
                "of this step; then run again (it resumes from that checkpoint)")

    def _count_skips(self, *, step: int, engine, stats) -> None:
        total = int(getattr(engine, "skipped_steps", 0))
        skipped = total > self._skipped_total
        self._skipped_total = total
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if _any_rank(self.skipped_in_a_row >= self.max_skipped_steps):  # every rank stops, or none
            raise TrainingDiverged(
                f"[too_many_skipped_steps] step {step}: fp16's loss scale overflowed on {self.skipped_in_a_row} "
                f"steps in a row (training.max_skipped_steps={self.max_skipped_steps}; loss {stats.loss}); the "
                f"weights have not moved since; {self._resume_from()}\nfix: train in bf16 "
                "(training.precision: bf16), lower training.lr, or raise training.max_skipped_steps")

    def _resume_from(self) -> str:
        if self.last_checkpoint is None:
            return "no checkpoint was written"
        return f"the last checkpoint is {self.last_checkpoint}"


def _any_rank(flag: bool) -> bool:
    """True on every rank when any rank's flag is: one MAX all-reduce on the backend's device (NCCL takes CUDA
    tensors only)."""
    import torch
    import torch.distributed as dist

    from toolkit import backend as backends

    value = torch.tensor([1.0 if flag else 0.0], device=backends.current().device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
