"""An independent one-process reference for `dsmt train` of a mixture-of-experts model: plain HF + torch.

It reuses reference.py's data rules, batch order, optimizer, clipping and LR schedule, and adds what an HF user's
MoE fine-tuning does with `output_router_logits: true` (DeepSeek's HF models add no such term; neither does this): each forward's loss gets `router_aux_loss_coef × aux`,
with aux HF's own `load_balancing_loss_func` of that forward's router logits. A forward here is one micro-batch
(the rows dsmt gives one rank at once), so the step's loss is the per-token LM loss of the global batch plus the
coefficient times the mean over micro-batches of their aux. The data must make every row one full record
(`data.packing: false`, records of exactly seq_length + 1 tokens): no padding, and one forward per micro-batch
attends exactly as per-document forwards would.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from reference import (ReferenceRun, RunSettings, adamw, clip_and_step, count_tokens, global_sample_indices,
                       load_examples)


def micro_batch_loss(model, *, rows: list, num_tokens: int, num_micro_batches: int) -> torch.Tensor:
    """LM loss sum / the step's tokens + coefficient × aux / micro-batches, for one micro-batch of full rows."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    ids = torch.tensor([row[0][0] for row in rows])
    counted = torch.tensor([row[0][1] for row in rows], dtype=torch.float32)[:, 1:]
    output = model(input_ids=ids[:, :-1], output_router_logits=True)
    per_token = torch.nn.functional.cross_entropy(output.logits.float().flatten(0, 1), ids[:, 1:].flatten(),
                                                  reduction="none")
    config = model.config
    loss = (per_token * counted.flatten()).sum() / num_tokens
    if not getattr(config, "output_router_logits", False):  # DeepSeek: HF adds no load-balancing term
        return loss
    aux = load_balancing_loss_func(output.router_logits, num_experts(config), config.num_experts_per_tok, None)
    return loss + config.router_aux_loss_coef * aux / num_micro_batches


def num_experts(config) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or config.num_local_experts


def train_moe_reference(spec_path: Path, *, start_rounded_to: torch.dtype | None = None) -> ReferenceRun:
    """Train the spec's MoE model for its train_steps; the state dict comes back with the checkpoint's names
    (per-expert tensors, as save_pretrained writes them). `start_rounded_to=torch.bfloat16` starts from the
    checkpoint rounded to bf16, as a bf16 run's fp32 master weights do (training stays fp32), as reference.py's
    `train_reference` does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    settings = RunSettings.from_yaml(spec_path)
    rows = load_examples(settings)
    window = settings.seq_length + 1
    if settings.packing or any(len(row) != 1 or len(row[0][0]) != window for row in rows):
        raise ValueError(f"the MoE reference needs one record of exactly {window} tokens per row (packing: false)")
    model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
    if start_rounded_to is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(start_rounded_to).float())
    optimizer, params = adamw(model, settings), list(model.parameters())
    losses, norms, lrs = [], [], []
    micro = settings.micro_batch_size
    for step in range(settings.train_steps):
        chosen = [rows[j] for j in global_sample_indices(step=step, global_batch_size=settings.global_batch_size,
                                                         num_examples=len(rows), seed=settings.seed,
                                                         shuffle=settings.shuffle)]
        optimizer.zero_grad(set_to_none=True)
        num_tokens, num_micro_batches, total = count_tokens(chosen), len(chosen) // micro, 0.0
        for start in range(0, len(chosen), micro):  # global rows j..j+micro: one micro-batch of one DP rank
            loss = micro_batch_loss(model, rows=chosen[start:start + micro], num_tokens=num_tokens,
                                    num_micro_batches=num_micro_batches)
            loss.backward()
            total += loss.item()
        norm, lr = clip_and_step(optimizer, params=params, step=step, settings=settings)
        losses.append(total)
        norms.append(norm)
        lrs.append(lr)
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        state = {k: v for p in Path(saved).glob("*.safetensors") for k, v in load_file(p).items()}
    return ReferenceRun(losses=losses, grad_norms=norms, lrs=lrs, state_dict=state)
