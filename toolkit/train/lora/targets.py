"""Which HF modules of a family take a LoRA adapter, read from its weight table (`family_modules`), and their shapes.

A target is what PEFT would wrap on the transformers-5 model, named as PEFT matches it:
  * linear modules (`target_modules`, matched by their last name component): the attention projections (q_proj ...
    o_proj; multi-latent attention's q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj), the dense MLP
    (gate_proj / up_proj / down_proj) and a shared expert's;
  * the fused routed experts (`target_parameters` "experts.gate_up_proj" / "experts.down_proj": one A and B per
    expert, stored by PEFT as one pair per layer, toolkit/adapters/peft_names.py), for families that name their
    experts' module (`ModelFamily.peft_experts`).
Withheld: names PEFT on transformers 5 re-reads as the routed experts (peft/utils/transformers_weight_conversion.py
maps `gate_proj` / `up_proj` / `down_proj` of a DeepSeek, Qwen3-MoE or GLM-4.5 model, `w1` / `w2` / `w3` of a
Mixtral, onto the fused experts and drops them as modules). An adapter on such a model's shared experts or dense MLP
would load onto the wrong weights, so dsmt does not train one. The router (`mlp.gate.weight`, a target parameter
as PEFT names it) stays frozen unless a target names it.
"""

from __future__ import annotations

import dataclasses

from toolkit.adapters import transforms
from toolkit.adapters.peft_names import peft_redirected_names
from toolkit.adapters.transforms import Kind
from toolkit.errors import DsmtError

# megatron linear (within a layer) -> how its base layer is split: column / row over TP, duplicated (whole on every
# TP rank: MLA's down projections), or an expert's (split over expert-TP by the token dispatcher, which does the
# communication the linear leaves out).
LINEARS = {"self_attention.linear_qkv": "column", "self_attention.linear_q_proj": "column",
           "self_attention.linear_q_down_proj": "duplicated", "self_attention.linear_q_up_proj": "column",
           "self_attention.linear_kv_down_proj": "duplicated", "self_attention.linear_kv_up_proj": "column",
           "self_attention.linear_proj": "row", "mlp.linear_fc1": "column", "mlp.linear_fc2": "row",
           "mlp.shared_experts.linear_fc1": "column", "mlp.shared_experts.linear_fc2": "row",
           "mlp.experts.linear_fc1": "expert-column", "mlp.experts.linear_fc2": "expert-row", "mlp.router": "router"}
# An expert linear -> (PEFT's target parameter on the fused experts module, the adapter's transform kind)
EXPERT_LINEARS = {"mlp.experts.linear_fc1": ("gate_up_proj", Kind.GATE_UP_PACKED),
                  "mlp.experts.linear_fc2": ("down_proj", Kind.ROW)}


class LoraError(DsmtError):
    """A LoRA setting this model or run cannot take."""


class LoraFamilyError(LoraError):
    """A model family whose layers dsmt's LoRA cannot adapt (its `fix` says what to do instead)."""

    rule = "lora_family"
    fix = ("fine-tune the model fully (remove training.lora), or LoRA-train it with a plain HF + PEFT loop "
           "(dsmt's LoRA adapts megatron's attention, MLP and expert linears)")


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One HF module PEFT would wrap: `hf_path` with `*` for the layer (model.layers.*.self_attn.q_proj; for routed
    experts the fused parameter, model.layers.*.mlp.experts.gate_up_proj), its megatron linear, the linear's
    transform kind, which of the row's HF tensors it is (`slot`), and which layers have it (`layers`: the
    weight row's all / dense / moe)."""

    hf_path: str
    linear: str  # a key of LINEARS
    kind: Kind
    slot: int
    layers: str = "all"

    @property
    def expert(self) -> bool:
        return self.linear in EXPERT_LINEARS

    @property
    def router(self) -> bool:
        return self.linear == "mlp.router"

    @property
    def parameter(self) -> bool:
        """Adapted by PEFT through `target_parameters` (the fused experts, the router), not `target_modules`."""
        return self.expert or self.router

    @property
    def name(self) -> str:
        """What a target names: the last name component (PEFT's target_modules); for PEFT's target_parameters
        experts.<parameter> (the fused experts) and mlp.gate.weight (the router: long enough not to match
        Qwen2-MoE's shared_expert_gate.weight)."""
        parts = self.hf_path.rsplit(".", 2)
        if self.router:
            return f"{parts[-2]}.{parts[-1]}.weight"
        return f"{parts[-2]}.{parts[-1]}" if self.expert else parts[-1]

    def path_for(self, layer: int) -> str:
        return self.hf_path.replace("*", str(layer))

    def in_layer(self, layer: int, *, moe_layers: frozenset[int]) -> bool:
        return self.layers == "all" or (self.layers == "moe") == (layer in moe_layers)


def family_modules(family, *, rows=None) -> list[LoraModule]:
    """Every HF module of the family (or of one config's `rows`) that takes an adapter, in weight-table order."""
    _refuse_family(family)
    rows = {row.megatron: row for row in (rows or family.weights)}
    redirected = peft_redirected_names(family.model_type)
    modules = []
    for linear in LINEARS:
        if linear in EXPERT_LINEARS:
            row = rows.get(f"decoder.layers.*.{linear.replace('experts.', 'experts.*.')}.weight")
            if row is not None:
                parameter, kind = EXPERT_LINEARS[linear]
                modules.append(LoraModule(f"{family.peft_experts}.{parameter}", linear, kind, 0, row.layers))
            continue
        if linear == "mlp.router":  # transformers 5's `mlp.gate` module beside the experts (Mixtral's too)
            row = rows.get("decoder.layers.*.mlp.router.weight")
            if row is not None and family.peft_experts is not None:
                router = family.peft_experts.rsplit(".", 1)[0] + ".gate"
                modules.append(LoraModule(router, linear, Kind.REPLICATED, 0, row.layers))
            continue
        row = rows.get(f"decoder.layers.*.{linear}.weight")
        if row is None:
            continue
        for slot, hf in enumerate(row.hf):
            module = LoraModule(hf.removesuffix(".weight"), linear, row.kind, slot, row.layers)
            if module.name not in redirected:
                modules.append(module)
    return modules


def _refuse_family(family) -> None:
    if family.is_encoder:
        raise LoraError(f"training.lora on {family.model_type} (an encoder): dsmt's LoRA supports the decoder "
                        "families (GPTModel chunks) only; fine-tune the encoder fully (remove training.lora)")
    if family.multimodal_settings is not None:  # toolkit/adapters/multimodal.py
        raise LoraFamilyError(f"training.lora on {family.model_type}: a multimodal checkpoint's PEFT adapter would "
                              "name its modules by target name alone, the vision tower's q_proj / fc1 included, and "
                              "dsmt writes the language model's paths in the checkpoint's naming, not PEFT's")
    if any(row.per_expert for row in family.weights) and family.peft_experts is None:
        raise LoraFamilyError(f"training.lora on {family.model_type}: its routed experts take no LoRA adapter in dsmt "
                              "(adapted: Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2 / V3, GLM-4.5)")


def resolve_targets(family, targets: list[str] | None, *, rows=None) -> list[LoraModule]:
    """The modules `training.lora.targets` select (None: all of them). Raises LoraError naming the targets that
    match nothing, why where dsmt knows (a name PEFT redirects, the router), and the available names."""
    modules = family_modules(family, rows=rows)
    if targets is None:  # every module but the router, which stays frozen unless named
        return [module for module in modules if not module.router]
    available = list(dict.fromkeys(module.name for module in modules))
    unknown = [target for target in targets if target not in available]
    if unknown:
        reasons = _withheld_reasons(family, unknown)
        raise LoraError(f"training.lora.targets {unknown} match no {family.model_type} module dsmt adapts"
                        f"{reasons}; available: {', '.join(available)}")
    return [module for module in modules if module.name in targets]


def _withheld_reasons(family, unknown: list[str]) -> str:
    redirected = sorted(peft_redirected_names(family.model_type) & set(unknown) - {"gate"})
    reasons = []
    if redirected:
        reasons.append(f"{redirected}: PEFT on transformers 5 reads these names of a {family.model_type} model as "
                       "its fused routed experts (target experts.gate_up_proj / experts.down_proj for those), so "
                       "an adapter on the shared experts or dense MLP would load onto the wrong weights")
    if ("gate" in unknown or "router" in unknown) and family.peft_experts is not None:
        reasons.append("the router is named mlp.gate.weight, as PEFT's target_parameters name it")
    return f" ({'; '.join(reasons)})" if reasons else ""


def linear_shape(settings, linear: str) -> tuple[int, int]:
    """The layout-free megatron weight shape [out, in] of a layer's linear (one expert's for routed experts)."""
    fields = settings.transformer_fields
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    gated = 2 if fields.get("gated_linear_unit") else 1
    if linear.startswith("self_attention.") and fields.get("multi_latent_attention"):
        return _mla_shape(fields, linear)
    if linear == "mlp.router":
        return fields["num_moe_experts"], hidden
    groups, head_dim = fields["num_query_groups"], fields["kv_channels"]
    ffn = {"mlp.experts": fields.get("moe_ffn_hidden_size"),
           "mlp.shared_experts": fields.get("moe_shared_expert_intermediate_size")}.get(linear.rsplit(".", 1)[0],
                                                                                       fields["ffn_hidden_size"])
    return {"self_attention.linear_qkv": ((heads + 2 * groups) * head_dim, hidden),
            "self_attention.linear_proj": (hidden, heads * head_dim)}.get(
        linear, (ffn * gated, hidden) if linear.endswith("fc1") else (hidden, ffn))


def _mla_shape(fields: dict, linear: str) -> tuple[int, int]:
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    q_head = fields["qk_head_dim"] + fields["qk_pos_emb_head_dim"]
    return {"self_attention.linear_q_proj": (heads * q_head, hidden),
            "self_attention.linear_q_down_proj": (fields.get("q_lora_rank"), hidden),
            "self_attention.linear_q_up_proj": (heads * q_head, fields.get("q_lora_rank")),
            "self_attention.linear_kv_down_proj": (fields["kv_lora_rank"] + fields["qk_pos_emb_head_dim"], hidden),
            "self_attention.linear_kv_up_proj": (heads * (fields["qk_head_dim"] + fields["v_head_dim"]),
                                                 fields["kv_lora_rank"]),
            "self_attention.linear_proj": (hidden, heads * fields["v_head_dim"])}[linear]


def module_shape(settings, module: LoraModule) -> tuple[int, int]:
    """The HF module's (out_features, in_features) (one expert's for routed experts)."""
    shapes = transforms.expected_hf_shapes(module.kind, linear_shape(settings, module.linear),
                                           ctx=settings.shape_context())
    return tuple(shapes[module.slot])


def layers_with(settings, module: LoraModule) -> list[int]:
    """The global layer indices that have `module`."""
    return [layer for layer in range(settings.num_layers) if module.in_layer(layer, moe_layers=settings.moe_layers)]


def count_lora_params(hf_config, *, rank: int, targets: list[str] | None) -> int:
    """LoRA parameters of the whole model (every layer; every expert): r * (in + out) per targeted module."""
    from toolkit.adapters.hf_config import model_settings

    settings = model_settings(hf_config)
    total = 0
    for module in resolve_targets(settings.family, targets, rows=settings.rows):
        per_module = rank * sum(module_shape(settings, module)) * (settings.num_experts if module.expert else 1)
        total += per_module * len(layers_with(settings, module))
    return total
