"""An independent one-process reference for `dsmt train`: plain HF transformers + torch, nothing from toolkit/.

It reads the job spec YAML and the jsonl itself and re-implements, from their written rules, what a dsmt run
should do, so a parity test against it can catch bugs in dsmt's data pipeline, loss, optimizer and schedule:

  data       toolkit/data/tokenize.py docstring: a text record is a document (tokenizer defaults, EOS after it
             unless the tokenizer already ended it with EOS), every label in it counted; one longer than
             `seq_length + 1` is cut into consecutive pieces of `seq_length + 1`, each its own document (a piece of
             one token has no label: left out). A prompt/completion record is `prompt (tokenizer's specials) +
             completion + EOS`, loss on the completion and its EOS only, cut at the right to `seq_length + 1`.
             Records (pieces) with no counted label are dropped. `data.packing` (default true): records fill rows
             of `seq_length + 1` greedily in record order (one that does not fit starts the next row); false: one
             record per row. Rows are padded with the pad token (EOS without one).
  loss       per document: each record of a row goes through its own HF forward (positions from 0, attending
             only to itself), its counted labels summed; a row's padding and the label from one record to the
             next count nothing.
  order      toolkit/data/batches.py docstring: global position `g = step*G + j` is example
             `randperm(N, seed + g // N)[g % N]` (identity without shuffle); row `j` of the global batch is row `i`
             of micro-batch `m` on data-parallel rank `r` with `j = (m*dp + r)*micro + i`.
  loss       per token over the global batch: the sum of the documents' token cross entropies of all `G` rows
             divided by the number of counted tokens in them (HF's `num_items_in_batch`), whatever the micro-batch
             split.
  optimizer  torch.optim.AdamW, weight decay on parameters with ndim >= 2 only (norms and biases get 0, megatron's
             convention), gradients clipped to `grad_clip` by their global L2 norm (the pre-clip norm is returned).
  schedule   transformers' get_*_schedule_with_warmup for the spec's lr_schedule, warmup_steps, train_steps and
             min_lr, stepped after each optimizer step as HF's Trainer does: see `hf_schedule_lr`.
fp32 throughout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml


@dataclass(frozen=True)
class RunSettings:
    """The job-spec values the reference needs, read from the YAML as written (no dsmt spec classes)."""

    model_dir: Path
    data_path: Path
    text_field: str
    prompt_field: str | None
    completion_field: str | None
    shuffle: bool
    seq_length: int
    global_batch_size: int
    micro_batch_size: int
    lr: float
    min_lr: float
    lr_schedule: str
    warmup_steps: int
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    grad_clip: float
    train_steps: int
    seed: int
    packing: bool = True  # data.packing

    @classmethod
    def from_yaml(cls, path: Path) -> "RunSettings":
        spec = yaml.safe_load(Path(path).read_text())
        t, d = spec["training"], spec["data"]
        return cls(model_dir=Path(spec["model"]["path"]), data_path=Path(d["path"]),
                   text_field=d.get("text_field", "text"), packing=d.get("packing", True),
                   prompt_field=d.get("prompt_field"),
                   completion_field=d.get("completion_field"), shuffle=d.get("shuffle", True),
                   seq_length=t["seq_length"], global_batch_size=t["global_batch_size"],
                   micro_batch_size=t["micro_batch_size"], lr=t["lr"], min_lr=t["min_lr"],
                   lr_schedule=t["lr_schedule"], warmup_steps=t["warmup_steps"], weight_decay=t["weight_decay"],
                   betas=(t.get("adam_beta1", 0.9), t.get("adam_beta2", 0.95)), eps=t.get("adam_eps", 1e-8),
                   grad_clip=t["grad_clip"], train_steps=t["train_steps"], seed=t["seed"])


@dataclass(frozen=True)
class ReferenceRun:
    losses: list[float]
    grad_norms: list[float]  # before clipping
    lrs: list[float]
    state_dict: dict[str, torch.Tensor]


# --- data -------------------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


Record = tuple[list[int], list[int]]  # (ids, counted): counted[t] = 1 when ids[t] is a label that counts


def tokenize_records(*, records: list[dict], tokenizer, settings: RunSettings) -> list[list[Record]]:
    """The rows of the run: each a list of records (ids, counted), by the rules in the module docstring."""
    window, eos = settings.seq_length + 1, tokenizer.eos_token_id
    pieces = []
    for record in records:
        if settings.prompt_field is None:
            ids = tokenizer(record[settings.text_field])["input_ids"]
            ids = ids if ids and ids[-1] == eos else ids + [eos]
            pieces += [(ids[i:i + window], [0] + [1] * (len(ids[i:i + window]) - 1))
                       for i in range(0, len(ids), window)]
        else:
            prompt = tokenizer(record[settings.prompt_field])["input_ids"]
            completion = tokenizer(record[settings.completion_field], add_special_tokens=False)["input_ids"]
            ids = (prompt + completion + [eos])[:window]
            counted = ([0] * len(prompt) + [1] * (len(completion) + 1))[:window]
            pieces.append((ids, [0] + counted[1:]))  # the first token is never a label
    pieces = [piece for piece in pieces if any(piece[1])]
    if not settings.packing:
        return [[piece] for piece in pieces]
    rows, row, used = [], [], 0
    for piece in pieces:
        if row and used + len(piece[0]) > window:
            rows.append(row)
            row, used = [], 0
        row.append(piece)
        used += len(piece[0])
    return rows + ([row] if row else [])


def row_arrays(rows: list[list[Record]], *, window: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [N, window] int64, loss_mask [N, window - 1]) of the rows, to compare with dsmt's arrays."""
    token_ids = torch.full((len(rows), window), pad, dtype=torch.int64)
    counted = torch.zeros(len(rows), window)
    for r, row in enumerate(rows):
        start = 0
        for ids, flags in row:
            token_ids[r, start:start + len(ids)] = torch.tensor(ids)
            counted[r, start:start + len(ids)] = torch.tensor(flags, dtype=torch.float32)
            start += len(ids)
    return token_ids, counted[:, 1:]


def load_examples(settings: RunSettings) -> list[list[Record]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    return tokenize_records(records=read_jsonl(settings.data_path), tokenizer=tokenizer, settings=settings)


def load_pad_id(settings: RunSettings) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def global_sample_indices(*, step: int, global_batch_size: int, num_examples: int, seed: int,
                          shuffle: bool) -> list[int]:
    """Example index of each row `j` of the global batch of `step` (0-based)."""
    indices, permutations = [], {}
    for position in range(step * global_batch_size, (step + 1) * global_batch_size):
        epoch = position // num_examples
        if epoch not in permutations:
            permutations[epoch] = (torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + epoch))
                                   if shuffle else torch.arange(num_examples))
        indices.append(int(permutations[epoch][position % num_examples]))
    return indices


def rank_rows(*, micro_batch: int, dp_rank: int, micro_batch_size: int, dp_size: int) -> list[int]:
    """Rows `j` of the global batch that form micro-batch `micro_batch` of data-parallel rank `dp_rank`."""
    first = (micro_batch * dp_size + dp_rank) * micro_batch_size
    return list(range(first, first + micro_batch_size))


# --- schedule ---------------------------------------------------------------------------------------------------

def clip_and_step(optimizer, *, params: list, step: int, settings: RunSettings) -> tuple[float, float]:
    """Clip the gradients to `grad_clip` by their global L2 norm, set this step's lr, step; (pre-clip norm, lr)."""
    max_norm = settings.grad_clip if settings.grad_clip > 0 else float("inf")
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    lr = hf_schedule_lr(step=step, settings=settings)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return norm, lr


def hf_schedule_lr(*, step: int, settings: RunSettings) -> float:
    """The LR of optimizer step `step` (0-based) under transformers' schedule for the spec's lr_schedule, stepped
    as HF's Trainer steps it (after each optimizer step): the LambdaLR's rate after `step` scheduler steps."""
    import transformers

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
    total, warmup = settings.train_steps, settings.warmup_steps
    scheduler = {
        "cosine": lambda: transformers.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=warmup, num_training_steps=total, min_lr=settings.min_lr),
        "linear": lambda: transformers.get_linear_schedule_with_warmup(optimizer, warmup, total),
        "constant": lambda: transformers.get_constant_schedule_with_warmup(optimizer, warmup),
    }[settings.lr_schedule]()
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


# --- training ---------------------------------------------------------------------------------------------------

def adamw(model: torch.nn.Module, settings: RunSettings) -> torch.optim.AdamW:
    """Weight decay on matrices only, as HF's Trainer: not on norms and biases, also where a bias is stored 2-D
    (GPT-OSS's experts' biases stacked [E, width])."""
    decayed = [p for name, p in model.named_parameters() if p.ndim >= 2 and not name.endswith("bias")]
    plain = [p for name, p in model.named_parameters() if p.ndim < 2 or name.endswith("bias")]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": settings.weight_decay},
                              {"params": plain, "weight_decay": 0.0}],
                             lr=settings.lr, betas=settings.betas, eps=settings.eps)


def count_tokens(rows: list[list[Record]]) -> int:
    return sum(sum(flags) for row in rows for _, flags in row)


def document_loss_sum(model, record: Record) -> torch.Tensor:
    """The summed cross entropy of one record's counted labels, from a forward of that record alone."""
    ids, flags = record
    logits = model(input_ids=torch.tensor([ids[:-1]])).logits.float()[0]
    per_token = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    return (per_token * torch.tensor(flags[1:], dtype=torch.float32)).sum()


def global_batch_loss_backward(model, *, rows: list[list[Record]], chunk_rows: int) -> float:
    """Backward of the per-token loss of the whole global batch (one forward per document), `chunk_rows` rows per
    backward; returns the loss."""
    num_tokens = count_tokens(rows)
    total = 0.0
    for start in range(0, len(rows), chunk_rows):
        loss = sum(document_loss_sum(model, record) for row in rows[start:start + chunk_rows] for record in row)
        loss = loss / num_tokens
        loss.backward()
        total += loss.item()
    return total


def train_reference(spec_path: Path, *, chunk_rows: int | None = None,
                    start_rounded_to: torch.dtype | None = None) -> ReferenceRun:
    """Train the spec's model for its train_steps in this process; `chunk_rows` (default: the micro-batch size)
    only changes how the global batch is split into forwards, not the result. `start_rounded_to=torch.bfloat16`
    starts from the checkpoint rounded to bf16, as a bf16 run's fp32 master weights do (training stays fp32)."""
    settings = RunSettings.from_yaml(spec_path)
    rows = load_examples(settings)
    model = load_hf_model(settings.model_dir)
    largest, vocab_size = max(max(ids) for row in rows for ids, _ in row), model.get_input_embeddings().num_embeddings
    if largest >= vocab_size:
        raise ValueError(f"token id {largest} >= vocab_size {vocab_size}")
    if start_rounded_to is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(start_rounded_to).float())
    losses, norms, lrs = run_steps(model, optimizer=adamw(model, settings), params=list(model.parameters()),
                                     rows=rows, settings=settings, chunk_rows=chunk_rows or settings.micro_batch_size)
    return ReferenceRun(losses=losses, grad_norms=norms, lrs=lrs, state_dict=saved_state(model))


# Multimodal checkpoints a user fine-tunes on text: transformers' image-text class, fed input_ids only (its vision
# tower gets no gradient, so AdamW leaves it as it is).
MULTIMODAL_MODEL_TYPES = ("gemma3", "mistral3", "qwen2_5_vl")


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = AutoConfig.from_pretrained(model_dir).model_type in MULTIMODAL_MODEL_TYPES
    model_class = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return model_class.from_pretrained(model_dir, dtype=torch.float32)


def saved_state(model) -> dict[str, torch.Tensor]:
    """The trained tensors under the names a checkpoint stores them by: save_pretrained's (a multimodal class saves
    `language_model.model.*`, not its modules' `model.language_model.*`), else the modules' own."""
    import tempfile

    from safetensors.torch import load_file

    if model.config.model_type not in MULTIMODAL_MODEL_TYPES:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        return {k: v for path in sorted(Path(saved).glob("*.safetensors")) for k, v in load_file(path).items()}


def run_steps(model, *, optimizer, params: list, rows: list[list[Record]], settings: RunSettings,
                chunk_rows: int) -> tuple[list[float], list[float], list[float]]:
    """The spec's train_steps over `rows`: each step's global batch, its loss backward, clipping and the optimizer
    step. Returns the losses, the grad norms before clipping and the step LRs."""
    losses, norms, lrs = [], [], []
    for step in range(settings.train_steps):
        chosen = global_sample_indices(step=step, global_batch_size=settings.global_batch_size,
                                       num_examples=len(rows), seed=settings.seed, shuffle=settings.shuffle)
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_batch_loss_backward(model, rows=[rows[j] for j in chosen], chunk_rows=chunk_rows))
        norm, lr = clip_and_step(optimizer, params=params, step=step, settings=settings)
        norms.append(norm)
        lrs.append(lr)
    return losses, norms, lrs
