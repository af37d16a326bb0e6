"""An independent one-process reference for `dsmt train` of a BERT-style encoder: plain HF transformers + torch,
nothing from toolkit/. It reads the job spec YAML and the jsonl itself and re-implements, from their written rules,
what a dsmt run should do (see reference.py for the order, optimizer and LR schedule it shares):

  task       the class in config.architectures[0]: *ForMaskedLM -> masked LM, *ForSequenceClassification ->
             regression (num_labels == 1) or classification on `data.label_field`.
  data       toolkit/data/tasks.py docstring: one example per record, the tokenizer's defaults, truncated at
             `seq_length` and padded to it (attention_mask 0 there). Masked LM: HF's DataCollatorForLanguageModeling
             (15 %, 80/10/10) on ONE row at a time, its generator seeded with `seed * 2**32 + g` for the row at
             global sample position `g`; special tokens and padding never masked.
  loss       masked LM: cross entropy summed over the masked tokens of the global batch / their number;
             regression: squared error summed over the global batch / its rows (HF's MSELoss mean);
             classification: cross entropy summed / rows.
fp32 throughout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from reference import (ReferenceRun, RunSettings, adamw, clip_and_step, global_sample_indices,
                       read_jsonl)


def load_model(model_dir: Path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    architecture = config.architectures[0]
    auto = (transformers.AutoModelForMaskedLM if architecture.endswith("ForMaskedLM")
            else transformers.AutoModelForSequenceClassification)
    return auto.from_pretrained(model_dir, dtype=torch.float32)


def encode(*, spec_path: Path, settings: RunSettings, tokenizer) -> dict[str, torch.Tensor]:
    data = yaml.safe_load(Path(spec_path).read_text())["data"]
    records = read_jsonl(settings.data_path)
    encoded = tokenizer([r[settings.text_field] for r in records], truncation=True, max_length=settings.seq_length,
                        padding="max_length", return_special_tokens_mask=True, return_tensors="pt")
    rows = {key: encoded[key] for key in ("input_ids", "attention_mask", "token_type_ids")}
    rows["never_masked"] = encoded["special_tokens_mask"].bool() | (encoded["attention_mask"] == 0)
    label_field = data.get("label_field", "label")
    if label_field in records[0]:
        rows["labels"] = torch.tensor([r[label_field] for r in records])
    return rows


def masked_rows(*, rows: dict, indices: list[int], positions: range, tokenizer, seed: int):
    """(input_ids, labels) of the rows at these global positions, masked one row at a time."""
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=True, mlm_probability=0.15)
    ids, labels = [], []
    for index, position in zip(indices, positions):
        collator.generator = torch.Generator().manual_seed(seed * 2**32 + position)
        masked, row_labels = collator.torch_mask_tokens(rows["input_ids"][index][None].clone(),
                                                        special_tokens_mask=rows["never_masked"][index][None])
        ids.append(masked[0])
        labels.append(row_labels[0])
    return torch.stack(ids), torch.stack(labels)


def global_batch_loss_backward(model, *, batch: dict, chunk_rows: int) -> float:
    """Backward of the loss of the whole global batch (module docstring), `chunk_rows` rows per forward."""
    masked_lm = model.config.architectures[0].endswith("ForMaskedLM")
    units = (batch["labels"] != -100).sum() if masked_lm else len(batch["labels"])
    total = 0.0
    for start in range(0, len(batch["labels"]), chunk_rows):
        part = {key: value[start:start + chunk_rows] for key, value in batch.items()}
        labels = part.pop("labels")
        logits = model(**part).logits.float()
        if masked_lm:
            summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                       reduction="sum")
        elif model.config.num_labels == 1:
            summed = (logits.view(-1) - labels.float()).pow(2).sum()
        else:
            summed = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        loss = summed / units
        loss.backward()
        total += loss.item()
    return total


def train_reference(spec_path: Path) -> ReferenceRun:
    from transformers import AutoTokenizer

    settings = RunSettings.from_yaml(spec_path)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    rows = encode(spec_path=spec_path, settings=settings, tokenizer=tokenizer)
    model = load_model(settings.model_dir)
    model.train()  # dropout is 0 in the test models: train mode changes nothing but is what dsmt runs
    optimizer = adamw(model, settings)
    params = list(model.parameters())
    masked_lm = model.config.architectures[0].endswith("ForMaskedLM")
    losses, norms, lrs = [], [], []
    for step in range(settings.train_steps):
        count, size = len(rows["input_ids"]), settings.global_batch_size
        indices = global_sample_indices(step=step, global_batch_size=size, num_examples=count, seed=settings.seed,
                                        shuffle=settings.shuffle)
        batch = {key: rows[key][indices] for key in ("input_ids", "attention_mask", "token_type_ids")}
        if masked_lm:
            batch["input_ids"], batch["labels"] = masked_rows(rows=rows, indices=indices, tokenizer=tokenizer,
                                                              positions=range(step * size, (step + 1) * size),
                                                              seed=settings.seed)
        else:
            batch["labels"] = rows["labels"][indices]
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_batch_loss_backward(model, batch=batch, chunk_rows=settings.micro_batch_size))
        norm, lr = clip_and_step(optimizer, params=params, step=step, settings=settings)
        norms.append(norm)
        lrs.append(lr)
    return ReferenceRun(losses=losses, grad_norms=norms, lrs=lrs,
                        state_dict={k: v.detach().clone() for k, v in model.state_dict().items()})
