"""Job specs for CPU training tests and the single-process HF reference they are compared with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"


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
        spec[section].update(values)
    path.write_text(yaml.safe_dump(spec))
    return path


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def hf_reference(*, model_dir: Path, spec_path: Path, lrs: list[float]) -> tuple[list[float], dict]:
    """Plain HF + torch AdamW in this process on the same global batches; returns (losses, final state dict)."""
    from transformers import AutoModelForCausalLM

    from toolkit.data import MicroBatches, build_examples
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import load_spec

    spec = load_spec(spec_path)
    layout = derive_layout(spec)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = build_examples(data=spec.data, model_path=str(model_dir), seq_length=layout.seq_length,
                              vocab_size=model.config.vocab_size, seed=spec.training.seed)
    # One process holding every data-parallel rank's micro-batches, in the pipeline's (micro-batch, rank) order.
    batches = MicroBatches(examples=examples, micro_batch_size=layout.micro_batch_size,
                           num_microbatches=layout.grad_accum_steps * layout.dp, dp_rank=0, dp_size=1,
                           seed=spec.training.seed, shuffle=spec.data.shuffle)
    t = spec.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=lrs[0], betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                  weight_decay=t.weight_decay)
    losses = []
    for step, lr in enumerate(lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_losses = []
        for batch in batches.batches_for_step(step):
            logits = model(input_ids=batch["tokens"]).logits
            per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
            micro_losses.append((per_token * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum())
        loss = torch.stack(micro_losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
