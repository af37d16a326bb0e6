"""Independent references for the plain (no-adapter) training tests: plain torch / HF code, nothing from toolkit/.
(No tests here; test_train_plain.py calls these.)

They re-implement from the written rules what a dsmt run should do:
  order      toolkit/data/batches.py docstring: global position `g = step*G + j` is example
             `randperm(N, seed + g // N)[g % N]`; row `j = (m*dp + r)*micro + i` is row `i` of micro-batch `m` on
             data-parallel rank `r`.
  images     toolkit/data/images.py docstring: examples sorted by path relative to the folder, class id = index of
             the sub-folder name in sorted order; RGB, bilinear resize to config.image_size, /255, ImageNet mean/std.
  text       toolkit/data/tasks.py docstring: one row per record, the tokenizer's defaults, truncated at and padded
             to seq_length; masked LM masks drawn per row from `Generator().manual_seed(seed * 2**32 + g)`:
             bernoulli(0.15 on non-special non-pad tokens), bernoulli(0.8) -> [MASK], bernoulli(0.5) of the rest
             -> randint(len(tokenizer)).
  loss       toolkit/train/plain/engine.py docstring: masked LM per token over the global batch; classification and
             regression the mean over the global batch.
  optimizer  torch.optim.AdamW on every parameter (DeepSpeed's torch AdamW gets one parameter group), the spec's
             lr (constant schedule), betas, eps, weight decay; no clipping.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def global_rows(*, step: int, global_batch: int, num_examples: int, seed: int) -> list[int]:
    rows = []
    for position in range(step * global_batch, (step + 1) * global_batch):
        permutation = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + position // num_examples))
        rows.append(int(permutation[position % num_examples]))
    return rows


def adamw(model, training: dict) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=training["lr"], betas=(training["adam_beta1"], training["adam_beta2"]),
                             eps=training["adam_eps"], weight_decay=training["weight_decay"])


# --- images: torch DistributedDataParallel on every rank of the launch ------------------------------------------

def read_image_folder(folder: Path, *, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image

    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    files = sorted((f.relative_to(folder).as_posix() for f in folder.rglob("*.png")))
    pixels, labels = [], []
    for name in files:
        image = Image.open(folder / name).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        array = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        pixels.append((array - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1))
        labels.append(classes.index(name.split("/")[0]))
    return torch.stack(pixels), torch.tensor(labels)


def train_resnet_ddp(*, spec: dict, out_file: Path) -> list[float]:
    """The spec's ResNet trained with DDP on this launch's ranks (gloo, already initialised); per-step loss, the
    mean over micro-batches and ranks. Rank 0 saves its final state_dict (weights and BatchNorm buffers)."""
    import torch.distributed as dist
    from transformers import ResNetForImageClassification

    rank, world = dist.get_rank(), dist.get_world_size()
    training = spec["training"]
    micro = training["micro_batch_size"]
    accumulation = training["global_batch_size"] // (micro * world)
    model = ResNetForImageClassification.from_pretrained(spec["model"]["path"], dtype=torch.float32)
    pixels, labels = read_image_folder(Path(spec["data"]["path"]), size=model.config.image_size)
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = adamw(ddp, training)
    losses = []
    for step in range(training["train_steps"]):
        rows = global_rows(step=step, global_batch=training["global_batch_size"], num_examples=len(labels),
                           seed=training["seed"])
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(1)
        for m in range(accumulation):
            mine = rows[(m * world + rank) * micro:(m * world + rank + 1) * micro]
            syncing = m == accumulation - 1  # DDP reduces on the last micro-batch only
            with contextlib.nullcontext() if syncing else ddp.no_sync():
                loss = ddp(pixel_values=pixels[mine], labels=labels[mine]).loss
                (loss / accumulation).backward()
            total += loss.detach() / accumulation
        optimizer.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if rank == 0:
        torch.save(model.state_dict(), out_file)
    return losses


# --- text: one process, the whole global batch in one forward ---------------------------------------------------

def mask_row(ids: torch.Tensor, *, special: torch.Tensor, mask_id: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    row, special = ids[None].clone(), special[None]
    selected = torch.bernoulli(torch.full(row.shape, 0.15).masked_fill(special, 0.0), generator=generator).bool()
    labels = torch.where(selected, row, -100)
    replaced = torch.bernoulli(torch.full(row.shape, 0.8), generator=generator).bool() & selected
    row[replaced] = mask_id
    randomised = torch.bernoulli(torch.full(row.shape, 0.5), generator=generator).bool() & selected & ~replaced
    words = torch.randint(vocab, row.shape, generator=generator)
    row[randomised] = words[randomised]
    return row[0], labels[0]


def train_text_reference(*, spec: dict) -> tuple[list[float], dict]:
    """The spec's masked LM or sequence classifier trained in this process; (per-step loss, final state_dict)."""
    import transformers

    training, data = spec["training"], spec["data"]
    model_dir = spec["model"]["path"]
    architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    records = [json.loads(line) for line in Path(data["path"]).read_text().splitlines() if line.strip()]
    encoded = tokenizer([r[data.get("text_field", "text")] for r in records], truncation=True, padding="max_length",
                        max_length=training["seq_length"], return_special_tokens_mask=True, return_tensors="pt")
    special = encoded["special_tokens_mask"].bool() | (encoded["attention_mask"] == 0)
    optimizer, losses = adamw(model, training), []
    size = training["global_batch_size"]
    for step in range(training["train_steps"]):
        rows = global_rows(step=step, global_batch=size, num_examples=len(records), seed=training["seed"])
        inputs = {"input_ids": encoded["input_ids"][rows], "attention_mask": encoded["attention_mask"][rows]}
        optimizer.zero_grad(set_to_none=True)
        if architecture.endswith("ForMaskedLM"):
            masked = [mask_row(encoded["input_ids"][row], special=special[row], mask_id=tokenizer.mask_token_id,
                               vocab=len(tokenizer), seed=training["seed"] * 2**32 + step * size + j)
                      for j, row in enumerate(rows)]
            inputs["input_ids"] = torch.stack([ids for ids, _ in masked])
            labels = torch.stack([labels for _, labels in masked])
            logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            loss = loss / (labels != -100).sum()
        else:
            targets = torch.tensor([float(records[row][data["label_field"]]) for row in rows])
            loss = torch.nn.functional.mse_loss(model(**inputs).logits.squeeze(-1), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_causal_reference(*, spec: dict) -> tuple[list[float], dict]:
    """The spec's causal LM in this process with tests/train/reference.py's data and loss rules (windows of
    seq_length tokens = its `seq_length - 1` plus the shifted label; per-token loss over the global batch), torch
    AdamW on every parameter, constant lr."""
    import transformers

    from reference import RunSettings, global_batch_loss_backward, global_sample_indices, read_jsonl, tokenize_records

    training, data = spec["training"], spec["data"]
    settings = RunSettings(
        model_dir=Path(spec["model"]["path"]), data_path=Path(data["path"]), text_field="text", prompt_field=None,
        completion_field=None, shuffle=True, seq_length=training["seq_length"] - 1,
        global_batch_size=training["global_batch_size"], micro_batch_size=training["micro_batch_size"],
        lr=training["lr"], min_lr=training["min_lr"], lr_schedule="constant", warmup_steps=0,
        weight_decay=training["weight_decay"], betas=(training["adam_beta1"], training["adam_beta2"]),
        eps=training["adam_eps"], grad_clip=0.0, train_steps=training["train_steps"], seed=training["seed"],
        packing=False)  # plain models take one record per row (toolkit/data/tasks.py)
    tokenizer = transformers.AutoTokenizer.from_pretrained(settings.model_dir)
    examples = tokenize_records(records=read_jsonl(settings.data_path), tokenizer=tokenizer, settings=settings)
    model = transformers.AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
    model.train()
    optimizer, losses = adamw(model, training), []
    for step in range(settings.train_steps):
        rows = global_sample_indices(step=step, global_batch_size=settings.global_batch_size,
                                     num_examples=len(examples), seed=settings.seed, shuffle=True)
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_batch_loss_backward(model, rows=[examples[j] for j in rows],
                                                 chunk_rows=settings.global_batch_size))
        optimizer.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
