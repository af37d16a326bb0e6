"""A PEFT LoRA adapter directory read for merging (toolkit/convert/merge_lora.py): its config and tensors, and the
PEFT options under which it is not a plain additive B @ A delta of its base, refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.errors import DsmtError

from toolkit.adapters.peft_names import CONFIG_FILE as ADAPTER_CONFIG
from toolkit.adapters.peft_names import WEIGHTS_FILE as ADAPTER_WEIGHTS
# adapter_config options under which the adapter is not a plain additive B @ A (or is relative to another base).
_REFUSED_OPTIONS = ("use_dora", "lora_bias", "layer_replication", "trainable_token_indices", "alora_invocation_tokens",
                    "arrow_config", "kasa_config", "velora_config", "monteclora_config", "use_bdlora", "use_qalora")
# init_lora_weights that change the base weights too: the adapter is relative to that changed base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


class MergeLoraError(DsmtError):
    """An adapter that cannot be merged into the base checkpoint as asked."""


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and every tensor of adapter_model.safetensors; refuses missing files and PEFT options
    whose adapter is not a plain LoRA delta, all in one error."""
    from safetensors.torch import load_file

    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (adapter_dir / name).is_file()]
    if missing:
        hint = (" (it has adapter_model.bin: re-save the adapter with save_pretrained(..., safe_serialization=True))"
                if (adapter_dir / "adapter_model.bin").is_file() else "")
        raise MergeLoraError(f"adapter directory {adapter_dir} lacks {', '.join(missing)}{hint}; a PEFT adapter "
                             "saved by PeftModel.save_pretrained has adapter_config.json and adapter_model.safetensors")
    config = read_json(adapter_dir / ADAPTER_CONFIG)
    problems = option_problems(config)
    if problems:
        raise MergeLoraError(f"adapter {adapter_dir} cannot be merged:\n  " + "\n  ".join(problems))
    return config, load_file(str(adapter_dir / ADAPTER_WEIGHTS))


def option_problems(config: dict) -> list[str]:
    """The adapter_config settings merge-lora refuses, each by name and value."""
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r}: merge-lora merges LoRA adapters (peft_type LORA) only")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r}: trained biases are not merged; train with bias='none'")
    for option in _REFUSED_OPTIONS:
        if config.get(option):
            problems.append(f"{option}={config[option]!r}: not a plain additive LoRA delta; merge-lora supports "
                            f"{option} unset, or merge with peft's own merge_and_unload()")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        problems.append(f"init_lora_weights={init!r} changes the base weights too, so this adapter is relative to "
                        "that changed base; re-save it with save_pretrained(..., "
                        "path_initial_model_for_weight_conversion=...) to make it relative to the original base")
    return problems


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MergeLoraError(f"{path} is not readable JSON ({err})") from err
