"""What a trainer answers: the megatron-core engine (`HybridEngine`), the plain HF engine
(toolkit/train/plain/engine.py: `PlainEngine`) and a script's run (toolkit/train/job/session.py: `TrainingRun`).
The training loop (toolkit/train/job/loop.py) steps, evaluates, saves and resumes through it alone, and never asks
which class it has (its validation set-up also reads an engine's `task` and `chunks`, where there are some).

Export is not part of it: exporting a megatron-core model needs the checkpoint it was built from and the job's
precision and LoRA (toolkit/train/job/run.py `export_trained`), which an engine does not hold; `dsmt train` gets
its export with its trainer (`loop.TrainParts`), a script from `TrainingRun.export_hf`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from toolkit.train.checkpoint.checkpoints import Resumed


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """What every checkpoint of a run records of its layout: `record` (`reshard.layout_record`; a checkpoint with
    an equal record resumes through DeepSpeed itself) and the global batch size (kept in the layout-free copy
    that other layouts resume from)."""

    record: dict
    global_batch_size: int


class Trainer(Protocol):
    """One rank's trainer. Collective: every rank calls each method with its own share.

    The engines take dsmt's token rows and answer `StepStats` / `EvalSums` (toolkit/train/engine/hybrid.py);
    `TrainingRun` takes a script's HF-convention micro-batches and answers the same values as dicts."""

    @property
    def engine(self) -> Any:
        """DeepSpeed's engine: its monitors, its step counters, its checkpoints."""

    def train_step(self, micro_batches) -> Any:
        """One optimizer step over this rank's micro-batches."""

    def eval_step(self, micro_batches) -> Any:
        """Forward only, dropout off: the loss summed over every rank's micro-batches and the units it counts."""

    def save(self, checkpoint_dir: Path, *, step: int, keep_checkpoints: int | None = None,
             layout: CheckpointLayout | None = None, background: bool = False, also_write=None) -> Path:
        """The checkpoint of `step` under `checkpoint_dir` (toolkit/train/checkpoint/checkpoints.py), with the
        layout-free state when the trainer has one and `layout` is given; returns the tag's directory (complete
        on return unless `background`: then once `checkpoints.wait_for_save` returns). `also_write`: see
        `checkpoints.save`."""

    def load(self, checkpoint_dir: Path, *, layout: CheckpointLayout | None = None, fallback: bool = True,
             owner: bool = False) -> Resumed:
        """The newest intact complete checkpoint under `checkpoint_dir` loaded (`checkpoints.resume`)."""


class EngineCheckpoints:
    """`Trainer.save` and `Trainer.load` for a trainer whose `engine` is DeepSpeed's: DeepSpeed's checkpoint with
    dsmt's record (toolkit/train/checkpoint/checkpoints.py), and the layout-free copy `layout_free` gives."""

    def layout_free(self, layout: CheckpointLayout):
        """The state other layouts resume from (a `reshard.LayoutFreeState`), or None: this trainer's checkpoints
        resume only at the layout that wrote them."""
        return None

    def save(self, checkpoint_dir: Path, *, step: int, keep_checkpoints: int | None = None,
             layout: CheckpointLayout | None = None, background: bool = False, also_write=None) -> Path:
        from toolkit.train.checkpoint import checkpoints

        checkpoints.save(engine=self.engine, checkpoint_dir=checkpoint_dir, step=step,
                         keep_checkpoints=keep_checkpoints, background=background, also_write=also_write,
                         **self._layout_arguments(layout))
        return Path(checkpoint_dir) / checkpoints.tag_for(step)

    def load(self, checkpoint_dir: Path, *, layout: CheckpointLayout | None = None, fallback: bool = True,
             owner: bool = False) -> Resumed:
        from toolkit.train.checkpoint import checkpoints

        return checkpoints.resume(engine=self.engine, checkpoint_dir=checkpoint_dir, fallback=fallback, owner=owner,
                                  **self._layout_arguments(layout))

    def _layout_arguments(self, layout: CheckpointLayout | None) -> dict:
        if layout is None:  # the marker records no layout; a resume then compares world sizes
            return {"layout": None, "layout_free": None}
        return {"layout": layout.record, "layout_free": self.layout_free(layout)}
