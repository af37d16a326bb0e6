"""`dsmt check` of training.lora: the model takes adapters, the targets name its modules, the rank fits every
targeted linear, and an init_adapter was made for this base (its targets and every tensor's shape), all before any
rank starts. The runs read the same things again (toolkit/train/lora/apply.py), with the same messages."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError, Problem
from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import spec_model_type
from toolkit.spec.schema import JobSpec

TARGETS_FIX = "set training.lora.targets to names listed above, or leave it unset for every module dsmt adapts"


def lora_settings(spec: JobSpec):
    """ModelSettings of the spec's HF config (model.path's config.json or model.config), for the rows and shapes
    of one config; None where there is none to read (the model checks say why)."""
    from transformers import AutoConfig

    from toolkit.adapters.hf_config import model_settings

    try:
        if spec.model.config is not None:
            fields = dict(spec.model.config)
            return model_settings(AutoConfig.for_model(fields.pop("model_type"), **fields))
        if spec.model.path is not None and (Path(spec.model.path) / "config.json").is_file():
            return model_settings(AutoConfig.from_pretrained(spec.model.path))
    except (DsmtError, OSError, ValueError, KeyError, TypeError):
        return None
    return None


def spec_lora_modules(spec: JobSpec, *, settings=None):
    """The HF modules `training.lora` adapts (toolkit/train/lora/targets.py), of the config's own rows where
    `settings` are known; raises LoraError / AdapterError."""
    from toolkit.adapters.family import get_family
    from toolkit.train.lora.targets import resolve_targets

    model_type = spec_model_type(spec)
    if model_type is None:
        raise DsmtError("training.lora: the model's config names no model_type, so its modules are unknown; set "
                        "model.config.model_type (e.g. llama) or use a checkpoint directory")
    rows = settings.rows if settings is not None else None
    return resolve_targets(get_family(model_type), spec.training.lora.targets, rows=rows)


def check_lora(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """training.lora needs pretrained weights of an adapter family whose linears it can split, targets that
    name its modules, a rank no larger than any targeted linear's smaller side, and an init_adapter made for this
    base."""
    from toolkit.adapters.family import AdapterError, supported_model_types
    from toolkit.train.lora.targets import LoraFamilyError

    lora = spec.training.lora
    if lora is None or (spec.model.path is not None and spec_model_type(spec) not in supported_model_types()):
        return []  # no adapter family: check_model_family's lora_needs_adapter
    if spec.model.builtin is not None:
        return [Problem("error", "lora_needs_weights", f"training.lora with model.builtin={spec.model.builtin}: the "
                        "base weights would be megatron-core's random initialisation, frozen",
                        "fine-tune a checkpoint (model.path) with LoRA, or pretrain without training.lora")]
    settings = lora_settings(spec)
    try:
        modules = spec_lora_modules(spec, settings=settings)
    except LoraFamilyError as err:
        return [Problem("error", err.rule, str(err), err.fix)]
    except (AdapterError, DsmtError) as err:
        return [Problem("error", "lora_targets", str(err), TARGETS_FIX)]
    problems = [Problem("info", "lora", f"LoRA rank {lora.rank} on {len(modules)} modules per layer "
                        f"({', '.join(dict.fromkeys(m.name for m in modules))}); base weights frozen")]
    if settings is not None:
        problems += rank_problems(settings=settings, modules=modules, rank=lora.rank)
        problems += expert_dropout_problems(modules=modules, dropout=lora.dropout)
    if lora.init_adapter is not None and not (Path(lora.init_adapter).expanduser() / "adapter_config.json").is_file():
        problems.append(Problem("error", "lora_init_adapter", f"training.lora.init_adapter={lora.init_adapter} holds "
                                "no adapter_config.json", "give a PEFT adapter directory (saved with "
                                "save_pretrained: adapter_config.json + adapter_model.safetensors), or unset it"))
    elif settings is not None:
        from toolkit.train.lora.export import init_adapter_problems

        problems += [p for p in init_adapter_problems(spec=spec, settings=settings) if p.severity != "info"]
    return problems


def rank_problems(*, settings, modules, rank: int) -> list[Problem]:
    """A rank above a targeted linear's smaller side (min(out, in)) adds parameters and no capacity: B A cannot
    have a higher rank than that side. An error, but for the router [E, h] (a warning): dsmt trains one rank for
    every module, and E (8 for Mixtral) would cap the rank of all of them."""
    from toolkit.train.lora.targets import module_shape

    small = {}
    for module in modules:
        out_features, in_features = module_shape(settings, module)
        if rank > min(out_features, in_features):
            small[module.name] = (out_features, in_features, module.router)
    problems = []
    for router in (False, True):
        chosen = {name: shape[:2] for name, shape in small.items() if shape[2] == router}
        if not chosen:
            continue
        listed = ", ".join(f"{name} [{out} x {inp}]" for name, (out, inp) in chosen.items())
        smallest = min(min(shape) for shape in chosen.values())
        problems.append(Problem(
            "warning" if router else "error", "lora_rank_too_large", f"training.lora.rank={rank} is larger than the "
            f"smaller side of {listed}: the product B A of such a linear cannot have a rank above that side",
            f"set training.lora.rank to at most {smallest}, or leave {', '.join(chosen)} out of "
            "training.lora.targets" + (" (the router's adapter trains; the extra rank adds nothing)" if router
                                       else "")))
    return problems


def expert_dropout_problems(*, modules, dropout: float) -> list[Problem]:
    from toolkit.train.lora.apply import require_no_expert_dropout
    from toolkit.train.lora.targets import LoraError

    try:
        require_no_expert_dropout(modules, dropout=dropout)
    except LoraError as err:
        return [Problem("error", "lora_expert_dropout", str(err), "set training.lora.dropout: 0")]
    return []
