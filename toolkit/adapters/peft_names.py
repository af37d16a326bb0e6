"""How PEFT names and lays out a LoRA adapter on a transformers-5 model: the facts both the training export
(toolkit/train/lora/export.py) and `dsmt convert merge-lora` (toolkit/convert/merge_lora.py) rest on.

Linear modules (`target_modules`): `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r];
delta = (alpha / r) * B @ A (transposed for a Conv1D, `fan_in_fan_out`).

Fused routed experts (`target_parameters`): transformers 5 keeps a MoE layer's experts as 3-D parameters of one
module (`model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] with rows [gate ; up], `down_proj` [E, H, I]); PEFT's
`ParamWrapper` (peft/tuners/lora/layer.py) adapts each with ONE pair for all experts:
    lora_A [r * E, in]: expert e's A is rows e*r .. (e+1)*r;
    lora_B [out, r * E]: expert e's B is columns e, e + E, e + 2E, ... (PEFT reshapes it to (out, r, E));
    delta_e = (alpha / r) * B_e @ A_e, [out, in] as the expert's slice of the parameter.
Two targeted parameters of one module nest: PEFT wraps them in the module's parameter order (gate_up_proj, then
down_proj), each wrapper around the previous, so the first is saved under `<module>.base_layer.lora_*` and the last
under `<module>.lora_*` (checked against peft by tests/train/lora/test_lora_moe.py).
"""

from __future__ import annotations

import torch

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"  # PeftModel.save_pretrained's
# A transformers-5 fused experts module's adaptable parameters, in the module's own order (PEFT's nesting order).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def peft_redirected_names(model_type: str | None) -> set[str]:
    """Module names PEFT on transformers 5 re-reads as a fused experts parameter or the router of `model_type`
    (gate_proj / up_proj / down_proj of a DeepSeek, Qwen3-MoE or GLM-4.5; w1 / w2 / w3 of a Mixtral; `gate`), read
    from peft's own conversion tables (peft/utils/transformers_weight_conversion.py); empty where it converts
    nothing, and without peft."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        return set()
    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    return set(conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {})) if pattern else set()


def peft_key(hf_module_path: str, matrix: str) -> str:
    """PEFT's saved name of a LoRA matrix ("lora_A" / "lora_B") of an HF module."""
    return f"{PEFT_PREFIX}{hf_module_path}.{matrix}.weight"


def expert_peft_key(experts_module: str, parameter: str, matrix: str, *, targeted: list[str]) -> str:
    """PEFT's saved name of the LoRA matrix of `parameter` of the fused experts module `experts_module`
    (model.layers.3.mlp.experts) when the parameters `targeted` of that module are adapted."""
    order = [name for name in EXPERT_PARAMETERS if name in targeted]
    depth = len(order) - 1 - order.index(parameter)
    return f"{PEFT_PREFIX}{experts_module}{'.base_layer' * depth}.{matrix}.weight"


def split_expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, *, num_experts: int
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's fused [r*E, in] / [out, r*E] pair -> per expert (A_e [r, in], B_e [out, r]) (views)."""
    rank = lora_a.shape[0] // num_experts
    return [(lora_a[e * rank:(e + 1) * rank], lora_b[:, e::num_experts]) for e in range(num_experts)]


def join_expert_factors(factors: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert (A_e [r, in], B_e [out, r]), in expert order -> PEFT's fused (lora_A [r*E, in], lora_B [out, r*E])."""
    num_experts = len(factors)
    lora_a = torch.cat([a for a, _ in factors], dim=0)
    out_features, rank = factors[0][1].shape
    lora_b = factors[0][1].new_empty(out_features, rank * num_experts)
    for e, (_, b) in enumerate(factors):
        lora_b[:, e::num_experts] = b
    return lora_a.contiguous(), lora_b
