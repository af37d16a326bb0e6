"""What a user sees of a run: one line per step on rank 0, metrics.jsonl, DeepSpeed's monitors (CSV /
TensorBoard / W&B, switched on in the job spec), the resolved configuration next to the checkpoints, a loss PNG.

metrics.jsonl holds one JSON line per training step (`step`, `loss`, `lr`, ...) and, with validation data, one
per evaluation: `{"step": s, "val_loss": ..., "val_tokens": ..., "eval_time_s": ...}`, `s` the number of steps
trained before it (0: the starting weights). Readers tell them apart by the `loss` / `val_loss` key."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.spec.preference import PREFERENCE_METHODS


def _say(line: str) -> None:
    """A line above the training bar (a plain print would be drawn into it on a terminal)."""
    import sys

    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def peak_memory_over_ranks_gib() -> float | None:
    """The largest `memory_in_use_gib` of all ranks (pipeline stages differ: the first holds the most
    activations); every rank must call it, at the same step."""
    import torch
    import torch.distributed as dist

    local = memory_in_use_gib()
    if local is None or not dist.is_initialized():
        return local
    from toolkit import backend

    peak = torch.tensor([local], dtype=torch.float64, device=backend.current().device)  # NCCL: the rank's GPU
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def memory_in_use_gib() -> float | None:
    """Peak device memory on CUDA; resident memory of this process on the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**30
    except ImportError:
        return None


def _finish_wandb_run() -> None:
    """End the W&B run DeepSpeed's wandb monitor started on this rank (DeepSpeed never does): its history is
    written now, and a next run in this process (`train_in_one_launch`) gets its own run, where wandb.init would
    return the active one."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


# the metrics the rank-0 line shows (all of them go to metrics.jsonl and the monitors)
SHOWN_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _metrics_text(metrics: dict) -> str:
    return "".join(f" | {name} {metrics[name]:.4f}" for name in SHOWN_METRICS if name in metrics)


class RunLog:
    def __init__(self, *, output_dir: Path, is_writer: bool, layout, spec, ds_config: dict):
        self.output_dir = Path(output_dir)
        self.is_writer = is_writer
        self.layout = layout
        self.log_interval = spec.training.log_interval
        self.eval_interval = spec.training.eval_interval
        self.history: list[dict] = []  # training steps of this run
        self.validation_history: list[dict] = []  # evaluations of this run
        self.global_batch_size = layout.global_batch_size
        # the tokens a step's rows hold: DPO pairs without packing take a row per side (global_batch_size counts pairs)
        unpacked_pairs = spec.training.method in PREFERENCE_METHODS and not spec.data.packing
        self.tokens_per_step = layout.tokens_per_step * (2 if unpacked_pairs else 1)
        if is_writer:
            self._write_resolved(spec=spec, ds_config=ds_config)

    def _write_resolved(self, *, spec, ds_config: dict) -> None:
        from toolkit.spec.load import dump_spec

        resolved = self.output_dir / "resolved"
        resolved.mkdir(parents=True, exist_ok=True)
        (resolved / "job.resolved.yaml").write_text(dump_spec(spec))
        (resolved / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        (resolved / "layout.json").write_text(json.dumps(self.layout.__dict__, indent=2) + "\n")

    def started(self, *, start_step: int, total_steps: int, validation=None, resharded: str | None = None) -> None:
        if not self.is_writer:
            return
        layout = self.layout
        resumed = f", resuming after step {start_step}" if start_step else ""
        if resharded:
            resumed += (f" (resharded {resharded}: model, fp32 master weights, Adam moments and step, LR schedule "
                        "and data position; RNG streams reseeded from training.seed and the step)")
        print(f"dsmt train: tp={layout.tp} pp={layout.pp} vpp={layout.vpp}"
              + (f" ep={layout.ep}" if layout.ep > 1 else "") + f" dp={layout.dp} world={layout.world_size}, "
              f"global batch {layout.global_batch_size} x {layout.seq_length} tokens, "
              f"{layout.grad_accum_steps} micro-batches of {layout.micro_batch_size} per rank, {total_steps} steps{resumed}",
              flush=True)
        if validation is not None:
            unit = getattr(validation, "unit_name", "counted tokens")
            rows = "pairs" if unit == "pairs" else "rows"
            counted = "" if unit == "pairs" else f" ({validation.counted_tokens} {unit})"
            print(f"dsmt train: validation loss over {validation.num_examples} {rows}{counted} at the start, every "
                  f"{self.eval_interval or total_steps} steps and at the end", flush=True)
        self._truncate_metrics(after_step=start_step)

    def _truncate_metrics(self, *, after_step: int) -> None:
        """A resumed run redoes the steps after its checkpoint: drop the killed run's lines for them, and keep the
        earlier ones (its step-0 validation included; a run that starts from step 0 keeps none)."""
        path = self.output_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines()
                if line and after_step > 0 and json.loads(line)["step"] <= after_step]
        path.write_text("".join(line + "\n" for line in kept))

    def step(self, *, step: int, stats, engine) -> None:
        tokens_per_s = self.tokens_per_step / stats.step_time_s
        record = {"step": step, "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                  "step_time_s": stats.step_time_s, "tokens_per_s": tokens_per_s,
                  "memory_gib": peak_memory_over_ranks_gib()}  # collective: step() runs on every rank
        metrics = getattr(stats, "metrics", None) or {}  # DPO: TRL's rewards/* and logps/* names
        record.update(metrics)
        self.history.append(record)
        # DeepSpeed's engine adds Train/Samples/lr (and loss_scale with fp16) at the same x: samples seen
        samples = step * self.global_batch_size
        events = [("Train/Samples/train_loss", stats.loss, samples)]
        if stats.grad_norm is not None:
            events.append(("Train/Samples/grad_norm", stats.grad_norm, samples))
        events += [(f"Train/Samples/{name}", value, samples) for name, value in metrics.items()]
        if not self._record(record, events=events, engine=engine):
            return
        if step % self.log_interval == 0 or step == 1:
            norm = "n/a" if stats.grad_norm is None else f"{stats.grad_norm:.3f}"
            memory = "n/a" if record["memory_gib"] is None else f"{record['memory_gib']:.2f} GiB"
            _say(f"step {step:5d} | loss {stats.loss:.4f}{_metrics_text(metrics)} | lr {stats.lr:.3e} | grad norm "
                 f"{norm} | {tokens_per_s:,.0f} tok/s | {stats.step_time_s:.2f} s | max mem {memory}")

    def validation(self, *, step: int, result, engine) -> None:
        """One evaluation after `step` training steps (0: before the first)."""
        metrics = getattr(result, "metrics", None) or {}
        units = "val_pairs" if metrics else "val_tokens"  # DPO's loss is per pair
        record = {"step": step, "val_loss": result.loss, units: result.units, "eval_time_s": result.eval_time_s,
                  **{f"val_{name}": value for name, value in metrics.items()}}
        self.validation_history.append(record)
        samples = step * self.global_batch_size
        events = [("Validation/val_loss", result.loss, samples)]
        events += [(f"Validation/val_{name}", value, samples) for name, value in metrics.items()]
        if not self._record(record, events=events, engine=engine):
            return
        _say(f"step {step:5d} | val_loss {result.loss:.4f}{_metrics_text(metrics)} | {result.units} "
             f"{'pairs' if metrics else 'tokens'} | {result.eval_time_s:.2f} s")

    def _record(self, record: dict, *, events: list[tuple[str, float, int]], engine) -> bool:
        """Append `record` to metrics.jsonl and `events` (name, value, samples seen) to DeepSpeed's monitors; only
        the writer (rank 0) does, and only it gets True."""
        if not self.is_writer:
            return False
        with (self.output_dir / "metrics.jsonl").open("a") as file:
            file.write(json.dumps(record) + "\n")
        if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
            engine.monitor.write_events(events)
        return True

    def finished(self) -> None:
        if not self.is_writer:
            return
        _finish_wandb_run()
        if not self.history:
            return
        self._plot_loss()
        first, last = self.history[0]["loss"], self.history[-1]["loss"]
        merged = self.output_dir / "final-hf"
        where = (f"HF checkpoint in {merged}" if merged.is_dir()  # training.lora.export: adapter writes only this:
                 else f"PEFT adapter in {self.output_dir / 'final-hf-adapter'}")
        print(f"dsmt train: done; loss {first:.4f} -> {last:.4f}; {where}", flush=True)

    def _plot_loss(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train, validation = self._metrics_lines()
        figure, axis = plt.subplots(figsize=(6, 3.5))
        axis.plot([r["step"] for r in train], [r["loss"] for r in train], marker="o", markersize=3, label="train")
        if validation:
            axis.plot([r["step"] for r in validation], [r["val_loss"] for r in validation], marker="s",
                      markersize=4, label="validation")
            axis.legend()
        axis.set(xlabel="step", ylabel="loss", title=f"dsmt train (tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp})")
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(self.output_dir / "loss_curve.png", dpi=120)
        plt.close(figure)

    def _metrics_lines(self) -> tuple[list[dict], list[dict]]:
        """(training, validation) lines of the whole run, the steps before a resume included; this run's own
        history when metrics.jsonl is gone."""
        path = self.output_dir / "metrics.jsonl"
        if not path.is_file():
            return self.history, self.validation_history
        lines = [json.loads(line) for line in path.read_text().splitlines() if line]
        return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]
