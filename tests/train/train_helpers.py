"""Job specs, launches and metrics for CPU training tests (the HF reference they are compared with is in
reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"
PROMPTS = REPO / "examples" / "data" / "tiny_prompts.jsonl"


def write_spec(path: Path, *, model_dir: Path, output_dir: Path, tp=1, pp=1, vpp=None, dp=2, zero=1, micro=2,
               global_batch=8, steps=5, lr=1e-3, checkpoint_interval=100, seq=32, extra: dict | None = None) -> Path:
    spec = {
        "model": {"path": str(model_dir)},
        "cluster": {"nodes": 1, "gpus_per_node": tp * pp * dp, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
        "parallel": {"tp": tp, "pp": pp, "vpp": vpp, "zero_stage": zero},
        "training": {"global_batch_size": global_batch, "micro_batch_size": micro, "seq_length": seq,
                     "precision": "fp32", "lr": lr, "min_lr": lr, "lr_schedule": "constant", "warmup_steps": 0,
                     "weight_decay": 0.1, "grad_clip": 0.0, "train_steps": steps,
                     "checkpoint_interval": checkpoint_interval, "log_interval": 1, "seed": 7,
                     "output_dir": str(output_dir)},
        "data": {"path": str(STORIES), "shuffle": True},
    }
    for section, values in (extra or {}).items():
        spec.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(spec))
    return path


def read_metrics(output_dir: Path) -> list[dict]:
    """The training-step lines of metrics.jsonl (validation lines have `val_loss` instead of `loss`)."""
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "val_loss" not in line]


def read_validation(output_dir: Path) -> list[dict]:
    """The validation lines of metrics.jsonl: `step`, `val_loss`, `val_tokens`, `eval_time_s`."""
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "val_loss" in line]


def run_dsmt(spec_path: Path, *flags: str) -> str:
    """`dsmt train --config spec_path [flags]` as the command line runs it (`toolkit.cli.main`: the checks, the run
    lock, the ranks it launches), in this process: a subprocess paid ~5 s per run to import torch, megatron-core and
    DeepSpeed again, which this process holds already. Fails with its output, else returns it: the launcher's lines
    and rank 0's console lines (they reach the launcher's file descriptor 2), stdout and stderr together."""
    import contextlib
    import io
    import os
    import sys
    import tempfile

    from toolkit import cli

    lines = io.StringIO()
    with tempfile.TemporaryFile() as console, contextlib.chdir(REPO):
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(console.fileno(), 1)
        os.dup2(console.fileno(), 2)
        try:
            with contextlib.redirect_stdout(lines), contextlib.redirect_stderr(lines):
                code = cli.main(["train", "--config", str(spec_path), *flags])
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        console.seek(0)
        output = lines.getvalue() + console.read().decode(errors="replace")
    if code != 0:
        # torchrun's summary of killed ranks fills the tail; the first rank's exception is what explains a failure
        errors = dict.fromkeys(line for line in output.splitlines()
                               if "Error:" in line and "ChildFailedError" not in line)
        raise AssertionError("dsmt train failed:\n" + "\n".join(list(errors)[:10]) + "\n--- tail:\n" + output[-3000:])
    return output


class FakeEngine:
    """DeepSpeed's save/load contract as toolkit/train/checkpoint/checkpoints.py uses it: a tag directory and the
    client state."""

    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "client.json").write_text(json.dumps(client_state))

    def load_checkpoint(self, load_dir, *, tag):
        return None, json.loads((Path(load_dir) / tag / "client.json").read_text())


# --- dsmt against the independent reference (reference.py) -----------------------------------------------------

PARITY_STEPS = 6
GRAD_CLIP = 0.5  # below every step's pre-clip norm in these runs (~2-3), so clipping acts on every step
# lr 0, lr/2, lr, then cosine to min_lr (transformers' get_cosine_with_min_lr_schedule_with_warmup, see reference.py)
PARITY_TRAINING = {"lr": 2e-3, "min_lr": 2e-4, "lr_schedule": "cosine", "warmup_steps": 2, "weight_decay": 0.1,
                   "grad_clip": GRAD_CLIP, "train_steps": PARITY_STEPS}
SFT_DATA = {"path": str(PROMPTS), "prompt_field": "prompt", "completion_field": "completion"}
SFT_SEQ = 64  # prompts are 18-42 characters, prompt + completion + EOS up to 88: some completions are cut


def parity_spec(path: Path, *, model_dir: Path, output_dir: Path, sft: bool = False, extra: dict | None = None,
                **layout) -> Path:
    """A spec for `layout` with the parity training settings (and prompt/completion data when `sft`)."""
    merged = {"training": dict(PARITY_TRAINING)}
    if sft:
        merged["data"] = dict(SFT_DATA)
        layout.setdefault("seq", SFT_SEQ)
    for section, values in (extra or {}).items():
        merged.setdefault(section, {}).update(values)
    return write_spec(path, model_dir=model_dir, output_dir=output_dir, steps=PARITY_STEPS, extra=merged, **layout)


def beyond_bf16_rounding(exported: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|exported - reference| beyond what rounding to bf16 explains, per element: half the bf16 spacing (8
    significant bits: spacing 2^(exponent - 7)) at the larger magnitude of the two. What remains is the difference
    between the trained (master) weights before the export rounded them."""
    magnitude = torch.maximum(exported.float().abs(), reference.abs()).clamp(min=1e-30)
    half_spacing = torch.exp2(torch.floor(torch.log2(magnitude)) - 8)
    return (exported.float() - reference).abs().sub(half_spacing).clamp(min=0)


def parity_figures(*, name: str, spec_path: Path, output_dir: Path, model_dir: Path,
                   bf16: bool = False) -> dict[str, float]:
    """Run the reference for a finished dsmt run's spec and return the worst differences: per-step loss and
    pre-clip grad norm (absolute), exported weights (absolute), and how far the reference weights moved.
    Asserts what holds at any precision: the steps, the lr of every step, clipping active, the exported keys.
    `bf16`: the reference starts from the checkpoint rounded to bf16 (as dsmt's fp32 master weights do) and the
    figures add the weight difference beyond the export's bf16 rounding (`beyond_bf16_rounding`)."""
    from safetensors.torch import load_file

    from reference import train_reference

    metrics = read_metrics(output_dir)
    assert [r["step"] for r in metrics] == list(range(1, PARITY_STEPS + 1))
    reference = train_reference(spec_path, start_rounded_to=torch.bfloat16 if bf16 else None)
    assert min(reference.grad_norms) > GRAD_CLIP, reference.grad_norms
    lrs = [r["lr"] for r in metrics]
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(lrs, reference.lrs)), (lrs, reference.lrs)
    exported = load_file(Path(output_dir) / "final-hf" / "model.safetensors")
    tied_only = set(reference.state_dict) - set(exported)
    assert set(exported) <= set(reference.state_dict) and tied_only <= {"lm_head.weight"}, tied_only
    start = {k: v.float() for k, v in load_file(Path(model_dir) / "model.safetensors").items()}
    if bf16:
        start = {k: v.to(torch.bfloat16).float() for k, v in start.items()}
    figures = {
        "loss": max(abs(r["loss"] - x) for r, x in zip(metrics, reference.losses)),
        "grad_norm": max(abs(r["grad_norm"] - x) for r, x in zip(metrics, reference.grad_norms)),
        "grad_norm_relative": max(abs(r["grad_norm"] - x) / x for r, x in zip(metrics, reference.grad_norms)),
        "weight": max((exported[k].float() - reference.state_dict[k]).abs().max().item() for k in exported),
        "moved": max((reference.state_dict[k] - start[k]).abs().max().item() for k in exported),
    }
    if bf16:
        excess = torch.cat([beyond_bf16_rounding(exported[k], reference.state_dict[k]).flatten() for k in exported])
        figures["weight_beyond_bf16"] = excess.max().item()
        figures["weight_beyond_bf16_p999"] = excess.quantile(0.999).item()
    print(f"\n{name:<34}" + " | ".join(f"{key} {value:.2e}" for key, value in figures.items()))
    print(f"{'':<34}dsmt loss {[round(r['loss'], 5) for r in metrics]} grad_norm "
          f"{[round(r['grad_norm'], 4) for r in metrics]}")
    print(f"{'':<34}ref  loss {[round(x, 5) for x in reference.losses]} grad_norm "
          f"{[round(x, 4) for x in reference.grad_norms]}")
    assert reference.losses[-1] < reference.losses[0]  # it learns
    assert figures["moved"] > 1e-3  # the weights compared are trained ones, not two copies of the start
    return figures


# --- several `dsmt train` runs in one launch ---------------------------------------------------------------------

def train_in_one_launch(*, runs: dict[str, Path], root: Path, nprocs: int, timeout: int = 1200) -> None:
    """`toolkit.train.job.run.train(spec=...)` for each spec, one after the other, in ONE torchrun launch of `nprocs`
    gloo ranks (imports cost ~6 s per process on 2 cores; the world group stays, megatron's groups are rebuilt per
    run). This file is the per-rank worker. Fails with the launch's output."""
    from ranks import run_on_ranks

    plan = Path(root) / "plan.json"
    plan.write_text(json.dumps({"runs": {name: str(path) for name, path in runs.items()}}))
    run_on_ranks(__file__, plan, nprocs=nprocs, timeout=timeout)


def _train_worker(plan_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    train_runs(json.loads(Path(plan_path).read_text()))


def train_runs(plan: dict) -> None:
    """Every run of a `train_in_one_launch` plan, one after the other, in this (already initialised) process
    group; megatron's groups are rebuilt for each run's layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit.spec.load import load_spec
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.train.job.run import train

    for spec_path in plan["runs"].values():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # checked in the test's process (as `dsmt train` checks before it launches)
        train(job=job_of(spec=load_spec(spec_path), report=Report(source=spec_path, problems=())))
    dist.barrier()


if __name__ == "__main__":
    import sys

    _train_worker(sys.argv[1])


def write_peft_adapter(model_dir, out_dir, *, rank: int, alpha: float, targets, seed: int, b_scale: float) -> Path:
    """peft's own LoRA adapter on the modules dsmt adapts for `targets` (toolkit/train/lora/targets.py: module names
    as target_modules; the fused experts and the router as target_parameters), A and B random (B times `b_scale`,
    so that every matrix gets a gradient from the first step), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.adapters.hf_config import model_settings
    from toolkit.train.lora.targets import resolve_targets

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    settings = model_settings(model.config)
    modules = resolve_targets(settings.family, targets, rows=settings.rows)
    parameters = sorted({module.name for module in modules if module.parameter})
    peft_model = get_peft_model(model, LoraConfig(
        r=rank, lora_alpha=alpha, init_lora_weights=False, target_parameters=parameters or None,
        target_modules=sorted({module.name for module in modules if not module.parameter})))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def cut_back(source: Path, target: Path, *, to_step: int, trim_metrics: bool = False) -> None:
    """A copy of a run as it was after `to_step`: later checkpoints and the exports dropped (and with `trim_metrics`
    the later metrics lines), `latest` naming `to_step`'s checkpoint."""
    import shutil

    from toolkit.train.checkpoint.checkpoints import LATEST, tag_for

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("final-*"))
    for tag in (target / "checkpoints").glob("step_*"):
        if int(tag.name[len("step_"):]) > to_step:
            shutil.rmtree(tag)
    (target / "checkpoints" / LATEST).write_text(tag_for(to_step))
    if trim_metrics:
        metrics = target / "metrics.jsonl"
        kept = [line for line in metrics.read_text().splitlines() if json.loads(line).get("step", 0) <= to_step]
        metrics.write_text("".join(line + "\n" for line in kept))
