"""The run of `dsmt train` once its trainer is built: resume, train to train_steps with checkpoints and validation,
stop on a diverged step, export, report. The same for every kind of trainer (megatron-core hybrid, plain HF): it
asks nothing of one but the `Trainer` protocol (toolkit/train/engine/trainer.py)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from toolkit.launch import heartbeat
from toolkit.train.checkpoint import checkpoints
from toolkit.train.engine.trainer import CheckpointLayout, Trainer
from toolkit.train.job.guard import StepGuard, TrainingDiverged
from toolkit.train.job.report import RunLog


@dataclasses.dataclass(frozen=True)
class TrainParts:
    """What `dsmt train` runs for one kind of model (toolkit/train/job/run.py: megatron-core or plain HF)."""

    trainer: Trainer  # toolkit/train/engine/trainer.py
    batches: Any  # `batches_for_step(step)`: this rank's micro-batches of a step
    export: Callable[[], None]  # collective, after the last step: the trained model into the output directory
    notice: str | None = None  # said once by rank 0 before the run starts
    # collective: the model as it is now, as transformers loads it, into the given folder (a checkpoint's hf/ at
    # training.export_hf_interval); None: this kind of model has none
    export_into: Callable[[Path], None] | None = None


def run_to_end(*, parts: TrainParts, job, layout, hf_dir: Path | None = None) -> list[dict]:
    """Every rank: the per-step history of the checked `job` (the same on every rank); `layout`: the one its process
    groups were made for."""
    import torch.distributed as dist

    from toolkit.train.job.evaluate import build_validation

    trainer, spec = parts.trainer, job.spec
    output_dir = Path(spec.training.output_dir)
    log = RunLog(output_dir=output_dir, is_writer=dist.get_rank() == 0, layout=layout, spec=spec,
                 ds_config=job.ds_config())
    if parts.notice and dist.get_rank() == 0:
        print(parts.notice, flush=True)
    validation = build_validation(spec=spec, layout=layout, trainer=trainer, hf_dir=hf_dir)
    saved_layout = checkpoint_layout(spec=spec, layout=layout)
    heartbeat.set_phase("resume")
    resumed = resume(trainer=trainer, checkpoint_dir=output_dir / "checkpoints", seed=spec.training.seed,
                     layout=saved_layout, fallback=job.resume_fallback, owner=True)
    log.started(start_step=resumed.step, total_steps=spec.training.train_steps, validation=validation,
                resharded=resumed.resharded)
    guard = StepGuard(precision=spec.training.precision, max_skipped_steps=spec.training.max_skipped_steps,
                      last_checkpoint=checkpoints.tag_for(resumed.step) if resumed.step else None,
                      engine=trainer.engine)
    train_steps(trainer=trainer, batches=parts.batches, spec=spec, log=log, start=resumed.step,
                output_dir=output_dir, validation=validation, layout=saved_layout, guard=guard,
                export_into=parts.export_into)
    if resumed.step == spec.training.train_steps and dist.get_rank() == 0:
        print(f"dsmt train: {output_dir} holds a checkpoint of step {resumed.step}, the last "
              "(training.train_steps): nothing left to train; exporting it again", flush=True)
    from toolkit.data.corpus_check import finish_digest_checks

    heartbeat.set_phase("checking corpus digests")
    finish_digest_checks()  # a run shorter than its corpus's background digest check must not export on damage
    heartbeat.set_phase("export")
    parts.export()
    log.finished()
    if dist.get_rank() == 0:  # the old checkpoints keep_checkpoints pruned, deleted by threads that must not die
        from toolkit.train.checkpoint.folders import wait_for_removals

        heartbeat.set_phase("removing pruned checkpoints")
        wait_for_removals()
    return log.history


def resume(*, trainer: Trainer, checkpoint_dir: Path, seed: int, layout: CheckpointLayout, fallback: bool = True,
           owner: bool = False) -> checkpoints.Resumed:
    """The newest intact complete checkpoint under `checkpoint_dir` loaded (`layout`: `checkpoint_layout`;
    `owner`: this run holds the directory's lock, see `checkpoints.resume`). Resharded from another layout, the
    RNGs are seeded anew: that layout's per-rank streams do not map onto this one's ranks."""
    from toolkit import backend as backends

    resumed = trainer.load(checkpoint_dir, layout=layout, fallback=fallback, owner=owner)
    if resumed.resharded:
        backends.current().seed(seed + resumed.step)
    return resumed


def checkpoint_layout(*, spec, layout) -> CheckpointLayout:
    """What this run's checkpoints record of its layout; a trainer that has a layout-free copy (megatron-core
    models) saves it too (`Trainer.save`)."""
    from toolkit.train.checkpoint.reshard import layout_record

    return CheckpointLayout(record=layout_record(layout=layout, zero_stage=spec.parallel.zero_stage),
                            global_batch_size=layout.global_batch_size)


def train_steps(*, trainer: Trainer, batches, spec, log, start: int, output_dir: Path, validation=None,
                layout: CheckpointLayout | None = None, guard: StepGuard | None = None,
                export_into: Callable[[Path], None] | None = None) -> None:
    """Train steps start+1 .. train_steps. With validation: the validation loss before the first step (step 0),
    after every eval_interval steps and after the last, measured before that step's checkpoint is saved, so a run
    resumed from a checkpoint already has the validation loss of its step. `guard` stops the run at a step whose
    loss or gradient norm is not finite, before anything of that step is saved. After a SIGTERM every rank stops
    after the same step, saves it and raises Preempted (toolkit/train/job/preemption.py). A save in the background
    (`training.async_save`) is finished at a later step once every rank's writer is done, and waited for before
    the next save, after the last step and before a preempted run stops."""
    import torch.distributed as dist

    from toolkit.train.job import preemption
    from toolkit.train.job.evaluate import eval_steps, evaluate

    total = spec.training.train_steps
    evaluated = set(eval_steps(eval_interval=spec.training.eval_interval, start=start, total=total)
                    if validation is not None else ())
    if start in evaluated:
        log.validation(step=start, result=evaluate(trainer=trainer, validation=validation), engine=trainer.engine)
    save = functools.partial(_save, trainer=trainer, spec=spec, output_dir=output_dir, layout=layout, guard=guard,
                             export_into=export_into)
    preemption.training_started()  # SIGTERM now stops at a step boundary (before: at once)
    # Rank 0's bar, on a terminal only (disable=None): in a log file its redraws would be noise.
    with tqdm(total=total, initial=start, desc="training", disable=True if dist.get_rank() != 0 else None,
              leave=False) as bar:
        for step in range(start, total):
            heartbeat.set_phase(f"step {step + 1}")
            stats = trainer.train_step(batches.batches_for_step(step))
            checkpoints.finish_save_if_written()  # collective: publishes a background save every rank has written
            log.step(step=step + 1, stats=stats, engine=trainer.engine)
            if guard is not None:
                try:
                    guard.check(step=step + 1, stats=stats, engine=trainer.engine)
                except TrainingDiverged:  # every rank: the save in flight is of an earlier, sound step
                    checkpoints.wait_for_save()
                    raise
            bar.update(1)
            if step + 1 in evaluated:
                log.validation(step=step + 1, result=evaluate(trainer=trainer, validation=validation),
                               engine=trainer.engine)
            stop = preemption.agreed_stop()  # collective: all ranks stop after the same step
            if stop and dist.get_rank() == 0:
                preemption.announce(step=step + 1)
            if stop or (step + 1) % spec.training.checkpoint_interval == 0 or step + 1 == total:
                save(step=step + 1)
            if stop:
                checkpoints.wait_for_save()
                saved = output_dir / "checkpoints" / checkpoints.tag_for(step + 1)
                heartbeat.set_phase(heartbeat.stopped_phase(saved=saved), now=True)  # the launcher reads it
                raise preemption.Preempted(step=step + 1)


def _save(*, trainer: Trainer, spec, output_dir: Path, step: int, layout: CheckpointLayout | None = None,
          guard: StepGuard | None = None, export_into: Callable[[Path], None] | None = None) -> None:
    from toolkit import backend as backends

    heartbeat.set_phase(f"saving {checkpoints.tag_for(step)}")
    interval = spec.training.export_hf_interval
    also_write = None
    if export_into is not None and interval is not None and step % interval == 0:
        also_write = lambda partial: export_into(partial / "hf")  # noqa: E731
    background = spec.training.async_save
    if background is None:  # on GPUs; the CPU backend's cores are the training's own
        background = backends.current().dist_backend == "nccl"
    trainer.save(output_dir / "checkpoints", step=step, keep_checkpoints=spec.training.keep_checkpoints,
                 layout=layout, background=background and step < spec.training.train_steps, also_write=also_write)
    if guard is not None:
        guard.saved(checkpoints.tag_for(step))
