"""A training run driven by the user's own script (`toolkit.api.initialize`): what `deepspeed.initialize` is for a
plain module, over megatron-core TP / PP chunks built from an HF checkpoint inside DeepSpeed ZeRO.

Every process of the job (started by `deepspeed`, torchrun or srun) calls `start_run(job=...)`; the returned
`TrainingRun` trains on the micro-batches the script brings (HF convention: toolkit/train/engine/hf_batches.py)
with the same engine, loss, checkpoints and export as `dsmt train` (toolkit/train/job/run.py,
toolkit/train/engine/hybrid.py, toolkit/train/checkpoint/checkpoints.py).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.train.checkpoint import checkpoints
from toolkit.train.engine import hf_batches
from toolkit.train.engine.trainer import CheckpointLayout


def start_run(*, job) -> TrainingRun:
    """Process groups for the checked job's layout, this rank's chunks with the checkpoint's weights (LoRA when
    asked), the DeepSpeed engine on the job's config (the one `dsmt generate` writes). Collective: every rank of
    the job calls it."""
    from megatron.core import parallel_state

    from toolkit.train.job.run import build_hybrid, model_checkpoint, start_process_groups

    if parallel_state.model_parallel_is_initialized():
        raise DsmtError("initialize: this process already holds a run's process groups (megatron's model-parallel "
                        "state); one run per process at a time: call run.close() before initializing another")
    spec = job.spec
    layout = start_process_groups(job=job)
    hf_dir = model_checkpoint(spec=spec, output_dir=Path(spec.training.output_dir))
    _require_causal_lm(hf_dir, builtin=spec.model.builtin is not None)
    ds_config = job.ds_config()
    hybrid, info = build_hybrid(spec=spec, layout=layout, hf_dir=hf_dir, ds_config=ds_config)
    return TrainingRun(spec=spec, layout=layout, hybrid=hybrid, info=info, hf_dir=hf_dir, ds_config=ds_config)


def _require_causal_lm(hf_dir: Path, *, builtin: bool) -> None:
    """The script API trains megatron-core causal LMs; the same answer on every rank (they read the same files)."""
    from toolkit.train.plain import engine as plain

    if plain.is_plain_model(hf_dir):
        raise DsmtError(f"model_type {plain.model_type_of(hf_dir)!r} has no megatron-core adapter, and "
                        "toolkit.api.initialize builds megatron-core models; for this model use "
                        "deepspeed.initialize on the HF model, or `dsmt train` (its plain ZeRO engine)")
    if builtin:
        return
    from toolkit.convert.chunks import inspect_checkpoint

    encoder = inspect_checkpoint(hf_dir).settings.encoder
    if encoder is not None:
        raise DsmtError(f"{hf_dir} is an encoder with a {encoder.task} head; toolkit.api.initialize trains causal "
                        "language models (input_ids / labels shifted inside); train encoders with `dsmt train`")


class TrainingRun:
    """One rank's share of the run. Micro-batches are this data-parallel rank's (every TP / PP / CP rank of a
    replica passes the same ones), `run.micro_batches_per_step` of them per optimizer step. A `Trainer`
    (toolkit/train/engine/trainer.py) over its `HybridEngine`."""

    def __init__(self, *, spec, layout, hybrid, info, hf_dir: Path, ds_config: dict):
        from megatron.core import parallel_state

        self.spec, self.layout, self.hybrid, self.info = spec, layout, hybrid, info
        self.model_dir, self.ds_config = Path(hf_dir), ds_config  # the HF checkpoint (its tokenizer)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.step = 0  # optimizer steps taken (or loaded from a checkpoint)
        self._rules = hf_batches.BatchRules(micro_batch_size=layout.micro_batch_size, seq_length=layout.seq_length,
                                            vocab_size=info.settings.vocab_size,
                                            packing_refusal=_packing_refusal(layout=layout, chunks=hybrid.chunks))
        self._read, self._padding = hf_batches.read_micro_batch, hf_batches.padding_rows
        from toolkit.spec.preference import PREFERENCE_METHODS

        if getattr(hybrid.task, "name", None) in PREFERENCE_METHODS:  # pairs (toolkit/train/engine/hf_pairs.py)
            from toolkit.train.engine import hf_pairs

            reference = ("none" if hybrid.task.name != "dpo" else "live" if hybrid.reference is not None
                         else "precomputed")
            self._read = hf_pairs.pair_reader(reference=reference)
            self._padding = hf_pairs.padding_pairs

    # The layout and the raw objects, for scripts that need them.
    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def micro_batches_per_step(self) -> int:
        return self.layout.grad_accum_steps

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def engine(self):
        """DeepSpeed's engine (its module: the chunks, or a ModuleList of them with virtual pipeline stages)."""
        return self.hybrid.engine

    @property
    def model_chunks(self) -> list:
        return self.hybrid.chunks

    def train_step(self, micro_batches) -> dict:
        """One optimizer step on `run.micro_batches_per_step` micro-batches pulled from the iterable
        `micro_batches`: {"loss" per token of the global batch, "grad_norm" (before clipping), "lr" of this step,
        "tokens" counted in the global batch}, the same on every rank. With `training.method: dpo` the micro-batches
        are pairs (toolkit/train/engine/hf_pairs.py), "loss" is per pair, "tokens" counts pairs, and TRL's
        rewards/* and logps/* means join."""
        rows, _ = self._take(micro_batches, count=self.micro_batches_per_step, what="train_step")
        if self.step == self.spec.training.train_steps and self.rank == 0:
            print(f"dsmt: step {self.step + 1} is beyond training.train_steps={self.spec.training.train_steps}, the "
                  "length of the LR schedule: the rate stays where the schedule ended (min_lr; 0 for linear "
                  "decay); raise training.train_steps to train longer", file=sys.stderr, flush=True)
        stats = self.hybrid.train_step(rows)
        self.step += 1
        # DPO: "tokens" counts pairs, and TRL's rewards/* and logps/* means join
        return {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr, "tokens": stats.tokens,
                **(stats.metrics or {})}

    def eval_step(self, micro_batches) -> dict:
        """Forward only, dropout off, over every micro-batch of the iterable (ranks may pass different numbers;
        the short ones are padded with rows that count nothing): {"loss" per token over all ranks' micro-batches,
        "tokens" counted}. Collective."""
        rows, counts = self._take(micro_batches, count=None, what="eval_step")
        needed = max(counts)
        if needed == 0:
            raise DsmtError("eval_step: no rank passed a micro-batch; pass at least one on some rank")
        if len(self.model_chunks) > 1:  # megatron's interleaved schedule takes a multiple of pp micro-batches
            needed = -(-needed // self.layout.pp) * self.layout.pp
        rows += [self._padding(self._rules) for _ in range(needed - len(rows))]
        sums = self.hybrid.eval_step(rows)
        return {"loss": sums.loss, "tokens": sums.units, **(sums.metrics or {})}

    def _take(self, micro_batches, *, count: int | None, what: str) -> tuple[list[dict], list[int]]:
        """(this rank's token rows, every rank's micro-batch count), or the same DsmtError on every rank."""
        from toolkit import backend as backends

        rows, problems = hf_batches.take_micro_batches(micro_batches, count=count, rules=self._rules, read=self._read)
        counts = hf_batches.agree(problems=problems, rows=rows, dp_rank=self.dp_rank, what=what,
                                  device=backends.current().device)
        return rows, counts

    def save_checkpoint(self, checkpoint_dir: str | Path) -> Path:
        """The checkpoint of this step (each rank's shard of the fp32 weights, Adam's moments, LR schedule, RNG), as
        `dsmt train` writes it (toolkit/train/checkpoint/checkpoints.py); returns the tag's directory. Collective."""
        return self.save(checkpoint_dir, step=self.step, keep_checkpoints=self.spec.training.keep_checkpoints,
                         layout=self._checkpoint_layout())

    def load_checkpoint(self, checkpoint_dir: str | Path, *, fallback: bool = True) -> int:
        """Resume from the newest complete checkpoint under `checkpoint_dir` (written at this layout or any other,
        by `save_checkpoint` or by `dsmt train` in OUTPUT_DIR/checkpoints); returns the step it holds. A directory
        with no complete checkpoint loads nothing and returns the run's own step (0 at the start). A checkpoint
        whose files do not match its manifest is named and the next older one taken (`fallback=False`: the
        named error instead). Collective."""
        from toolkit.launch.rank0 import on_rank0
        from toolkit.train.checkpoint.folders import checkpoint_io_error
        from toolkit.train.job.loop import resume

        newest = on_rank0(lambda: checkpoints.latest_complete(Path(checkpoint_dir)), what=f"reading {checkpoint_dir}",
                          os_error=checkpoint_io_error)
        if newest is None:  # rank 0's answer for every rank (NFS directory caches may differ between nodes)
            return self.step
        resumed = resume(trainer=self, checkpoint_dir=Path(checkpoint_dir), seed=self.spec.training.seed,
                         layout=self._checkpoint_layout(), fallback=fallback)
        return resumed.step

    # `Trainer.save` and `Trainer.load` (toolkit/train/engine/trainer.py): the engine's, this run's step following.
    def save(self, checkpoint_dir: str | Path, *, step: int, keep_checkpoints: int | None = None,
             layout: CheckpointLayout | None = None, background: bool = False, also_write=None) -> Path:
        return self.hybrid.save(Path(checkpoint_dir), step=step, keep_checkpoints=keep_checkpoints, layout=layout,
                                background=background, also_write=also_write)

    def load(self, checkpoint_dir: str | Path, *, layout: CheckpointLayout | None = None, fallback: bool = True,
             owner: bool = False) -> checkpoints.Resumed:
        resumed = self.hybrid.load(Path(checkpoint_dir), layout=layout, fallback=fallback, owner=owner)
        self.step = resumed.step
        return resumed

    def _checkpoint_layout(self) -> CheckpointLayout:
        from toolkit.train.job.loop import checkpoint_layout

        return checkpoint_layout(spec=self.spec, layout=self.layout)

    def export_hf(self, out_dir: str | Path, *, adapter_dir: str | Path | None = None,
                  overwrite: bool = False) -> Path:
        """The trained model as an HF checkpoint `out_dir` that `transformers` loads (LoRA merged in), and with
        LoRA the PEFT adapter in `adapter_dir` (default: OUT_DIR-adapter). Collective; refuses an existing
        `out_dir` unless `overwrite`, before anything is written."""
        import torch.distributed as dist

        from toolkit.train.job.run import export_trained

        out_dir = Path(out_dir)
        adapter_dir = Path(adapter_dir) if adapter_dir is not None else out_dir.with_name(out_dir.name + "-adapter")
        verdict = [_existing_output(out_dir) if dist.get_rank() == 0 and not overwrite else None]
        dist.broadcast_object_list(verdict, src=0)  # rank 0 decides for all: no rank races another's writes
        if verdict[0]:
            raise DsmtError(verdict[0])
        mcore_dir = out_dir.with_name(f".{out_dir.name}.mcore")
        lora = self.spec.training.lora  # asked for an HF export: merged and adapter, whatever the run's end writes
        lora = lora.model_copy(update={"export": "both"}) if lora is not None else None
        export_trained(hybrid=self.hybrid, info=self.info, precision=self.spec.training.precision,
                       lora=lora, mcore_dir=mcore_dir, hf_dir=out_dir, adapter_dir=adapter_dir,
                       status_file=out_dir.with_name(f".{out_dir.name}.status.json"))
        if dist.get_rank() == 0:  # every rank is past the export: the intermediate megatron copy can go
            shutil.rmtree(mcore_dir, ignore_errors=True)
        return out_dir

    def close(self) -> None:
        """Destroy the process groups (megatron's and the world), so that this process may initialize another run."""
        from toolkit.parallel.groups import destroy_process_groups

        destroy_process_groups()


def _packing_refusal(*, layout, chunks: list) -> str | None:
    """Why this layout cannot take packed records (position_ids restarting inside a row), as `dsmt check`'s
    packing rules say for `dsmt train`: checked on every rank before the step, not deep in a forward on some."""
    from toolkit.adapters import packed

    if layout.cp > 1:
        return (f"parallel.cp={layout.cp}: packed records are not cut for context parallelism; pass one record per "
                "row (right-padded, attention_mask) or set parallel.cp: 1")
    if layout.pp > 1 and layout.micro_batch_size > 1 and packed.uses_thd(chunks[0]):
        return (f"Transformer Engine's attention takes packed records as one THD row per micro-batch, and at "
                f"pp={layout.pp} the pipeline's activations are micro_batch_size x seq_length; set "
                "training.micro_batch_size: 1 or pass one record per row")
    return None


def _existing_output(out_dir: Path) -> str | None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        return (f"export_hf: {out_dir} already exists and is not empty; choose a new directory or pass "
                "overwrite=True to replace it")
    return None
