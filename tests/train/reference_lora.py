"""An independent one-process LoRA reference for `dsmt train` with training.lora: HF transformers + peft + torch,
nothing from toolkit/. The data, order, loss and schedule rules are reference.py's (imported, not changed); the
model is `PeftModel.from_pretrained(model, training.lora.init_adapter, is_trainable=True)`, the base frozen (but
the embedding and output layer with training.lora.train_embeddings, one tensor when tied), and torch.optim.AdamW over
the trained tensors (all 2-D: weight decay on every one, as PEFT + AdamW would), gradients clipped by their global L2
norm. fp32 throughout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from reference import RunSettings, load_examples, run_steps


@dataclass(frozen=True)
class LoraReferenceRun:
    losses: list[float]
    grad_norms: list[float]  # before clipping
    lrs: list[float]
    adapter: dict[str, torch.Tensor]  # PEFT's saved key names (base_model.model.<module>.lora_A.weight)


def train_lora_reference(spec_path: Path) -> LoraReferenceRun:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    settings = RunSettings.from_yaml(spec_path)
    lora = yaml.safe_load(Path(spec_path).read_text())["training"]["lora"]
    examples = load_examples(settings)  # rows of records (reference.py)
    base = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, lora["init_adapter"], is_trainable=True)
    config = model.peft_config["default"]
    assert (config.r, float(config.lora_alpha)) == (lora["rank"], float(lora["alpha"])), (config, lora)
    if lora.get("train_embeddings"):  # PEFT's modules_to_save: the whole embedding trains (a tied head with it)
        base.get_input_embeddings().weight.requires_grad_(True)
        base.get_output_embeddings().weight.requires_grad_(True)
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    assert params and all(p.ndim == 2 for p in params)
    optimizer = torch.optim.AdamW([{"params": params, "weight_decay": settings.weight_decay}], lr=settings.lr,
                                  betas=settings.betas, eps=settings.eps)
    losses, norms, lrs = run_steps(model, optimizer=optimizer, params=params, rows=examples, settings=settings,
                                     chunk_rows=settings.micro_batch_size)
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    if lora.get("train_embeddings"):  # under peft's saved names of modules_to_save (base_model.model.<module>.weight)
        for module in (base.get_input_embeddings(), base.get_output_embeddings()):
            name = next(n for n, m in base.named_modules() if m is module)
            adapter[f"base_model.model.{name}.weight"] = module.weight.detach().clone()
    return LoraReferenceRun(losses=losses, grad_norms=norms, lrs=lrs, adapter=adapter)
