"""The learning-rate schedule: transformers' own `get_*_schedule_with_warmup`, built from the spec and handed to
`deepspeed.initialize` as its client scheduler (DeepSpeed steps it after every optimizer step, as its own).

Why not DeepSpeed's schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR in 0.19): they start at iteration -1 with lr
0, and their first `step()` moves to iteration 0, whose warm-up factor is 0 again, so steps 1 and 2 both train at lr
0 (WarmupCosineLR also warms up over max(2, warmup) steps and starts its decay one step early). transformers'
LambdaLR gives optimizer step k (1-based) the factor lambda(k - 1): lr 0 at most at step 1, the schedule HF's
Trainer runs and the one users compare a fine-tune against."""

from __future__ import annotations

import dataclasses
import functools
import warnings

# spec lr_schedule -> the transformers function (all warm up linearly from 0 to lr over warmup_steps)
HF_SCHEDULES = {"cosine": "get_cosine_with_min_lr_schedule_with_warmup",  # decays to min_lr at train_steps
                "linear": "get_linear_schedule_with_warmup",              # decays to 0 at train_steps
                "constant": "get_constant_schedule_with_warmup"}


@dataclasses.dataclass(frozen=True)
class LrSchedule:
    """What the schedule needs from `training`; called with the optimizer it returns the LambdaLR (DeepSpeed calls a
    client scheduler that is callable with its basic optimizer, so ZeRO's wrappers see the same param groups)."""

    kind: str
    lr: float
    min_lr: float
    warmup_steps: int
    train_steps: int

    @classmethod
    def from_training(cls, training) -> "LrSchedule":
        return cls(kind=training.lr_schedule, lr=training.lr, min_lr=training.min_lr,
                   warmup_steps=training.warmup_steps, train_steps=training.train_steps)

    @property
    def hf_function(self) -> str:
        return HF_SCHEDULES[self.kind]

    def describe(self) -> str:
        """One line for summary.txt and the start of a run."""
        end = {"cosine": f"cosine to min_lr {self.min_lr} at step {self.train_steps}",
               "linear": f"linear to 0 at step {self.train_steps}", "constant": "then constant"}[self.kind]
        return (f"transformers.{self.hf_function}: warm-up 0 -> {self.lr} over {self.warmup_steps} steps, {end} "
                "(step 1 at lr 0 only when warming up)")

    def __call__(self, optimizer):
        import transformers

        build = getattr(transformers, self.hf_function)
        if self.kind == "constant":
            scheduler = build(optimizer, num_warmup_steps=self.warmup_steps)
        elif self.kind == "linear":
            scheduler = build(optimizer, num_warmup_steps=self.warmup_steps, num_training_steps=self.train_steps)
        else:
            scheduler = build(optimizer, num_warmup_steps=self.warmup_steps, num_training_steps=self.train_steps,
                              min_lr=self.min_lr)
        scheduler.__class__ = _resumable_class()  # the same LambdaLR, and it reads older dsmt checkpoints too
        return scheduler


@functools.cache
def _resumable_class():
    from torch.optim.lr_scheduler import LambdaLR

    class ResumableLambdaLR(LambdaLR):
        def load_state_dict(self, state_dict: dict) -> None:
            """transformers' LambdaLR state, or DeepSpeed's scheduler's from a dsmt checkpoint written before the
            switch ({"last_batch_iteration": i} after i + 1 steps): the schedule then goes on from step i + 2 (the
            old run's steps had DeepSpeed's rates; the rest follows transformers')."""
            if "lr_lambdas" in state_dict or "last_batch_iteration" not in state_dict:
                super().load_state_dict(state_dict)
                return
            self.last_epoch = state_dict["last_batch_iteration"]
            with warnings.catch_warnings():  # "step() before optimizer.step()": this is a resume, not a step
                warnings.simplefilter("ignore", UserWarning)
                self.step()  # last_epoch = the steps taken; the optimizer's lr = the next step's

    return ResumableLambdaLR
