"""Gemma 3 text (HF `Gemma3ForCausalLM`, model_type `gemma3_text`: Gemma-3-1B, and the text tower of the larger
ones): Gemma 2's layer (four (1 + w) norms, scale query_pre_attn_scalar ** -0.5, local layers with a sliding window,
optional softcaps) plus

* q / k RMSNorms over each head before RoPE (megatron's qk_layernorm, zero-centred as every Gemma norm);
* two RoPEs: the global layers' (`rope_parameters.full_attention`: rope_theta 1e6, linear scaling in 4B+) and the
  local layers' (`rope_parameters.sliding_attention`, older configs `rope_local_base_freq`: rope_theta 1e4);
* the local / global pattern from `layer_types` (older configs: `sliding_window_pattern`, which transformers turns
  into layer_types: 5 local layers, then a global one).

megatron-core's GPTModel computes one rotary table and hands it to every layer. Here the model's rotary module
returns both tables side by side on the last dim (`DualRotary`: global, then local), and each layer's attention
(`PerLayerRopeSelfAttention`) keeps the half its layer uses. The tables travel as an argument, not as state, so
recomputation, pipeline stages and packed records (position ids gathered on both halves) see the right one."""

from __future__ import annotations

import dataclasses
import functools

import torch

from toolkit.adapters.config_checks import layer_type_problems
from toolkit.adapters.family import ModelFamily, WeightMapping, register
from toolkit.adapters.families.gemma2 import (GEMMA2_ARCHITECTURE, GEMMA2_WEIGHTS, check_gemma2_config,
                                              edit_gemma2_layer_spec, edit_gemma2_model, read_gemma2_config,
                                              read_softcaps)
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.transforms import Kind

SLIDING, FULL = "sliding_attention", "full_attention"

QK_NORMS = (
    WeightMapping("decoder.layers.*.self_attention.q_layernorm.weight", Kind.REPLICATED,
                  ("model.layers.*.self_attn.q_norm.weight",)),
    WeightMapping("decoder.layers.*.self_attention.k_layernorm.weight", Kind.REPLICATED,
                  ("model.layers.*.self_attn.k_norm.weight",)),
)


def local_rope_theta(hf_config) -> tuple[float | None, str | None]:
    """(the local layers' rope_theta, problem): their RoPE must be the default (unscaled) kind."""
    local = (getattr(hf_config, "rope_parameters", None) or {}).get(SLIDING) or {}
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        return None, (f"rope_parameters.sliding_attention.rope_type={kind!r}: the gemma3_text adapter scales the "
                      "local layers' RoPE by nothing (as released); use rope_type 'default' for them")
    theta = local.get("rope_theta", getattr(hf_config, "rope_local_base_freq", 10000.0))
    return float(theta), None


def read_gemma3_quirks(hf_config) -> dict:
    local = tuple(kind == SLIDING for kind in hf_config.layer_types)
    # transformers' Gemma3Attention never passes attn_logit_softcapping to its attention (check_gemma3_config)
    return {**read_softcaps(hf_config), "attn_logit_softcapping": None,
            "local_rope_theta": local_rope_theta(hf_config)[0], "local_rope_layers": local}


def check_gemma3_config(hf_config) -> list[str]:
    problems = check_gemma2_config(hf_config)
    if getattr(hf_config, "attn_logit_softcapping", None):
        problems.append(f"attn_logit_softcapping={hf_config.attn_logit_softcapping}: transformers' Gemma 3 attention "
                        "ignores it (released Gemma 3 sets null), so what it would mean is unclear; set it to null")
    _, problem = local_rope_theta(hf_config)
    if problem:
        problems.append(problem)
    return problems + layer_type_problems(hf_config, family="gemma3_text")


class DualRotary(torch.nn.Module):
    """The model's rotary module: megatron's RotaryEmbedding for the global layers and one for the local layers,
    their tables concatenated on the last dim ([s, 1, 1, 2 x head_dim]: global, then local)."""

    def __init__(self, *, global_rotary: torch.nn.Module, local_rotary: torch.nn.Module):
        super().__init__()
        self.global_rotary, self.local_rotary = global_rotary, local_rotary

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.global_rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        tables = [rotary(max_seq_len, offset, packed_seq=packed_seq, cp_group=cp_group)
                  for rotary in (self.global_rotary, self.local_rotary)]
        return torch.cat(tables, dim=-1)


def layer_table(tables: torch.Tensor, *, local: bool) -> torch.Tensor:
    """A layer's half of `DualRotary`'s tables, contiguous: Transformer Engine's fused RoPE reads the frequencies
    through a raw pointer as a dense [s, 1, 1, d] array, so a strided view would give it the wrong rows."""
    global_table, local_table = tables.chunk(2, dim=-1)
    return (local_table if local else global_table).contiguous()


@functools.cache
def per_layer_rope_attention_class():
    """megatron's SelfAttention (local or TE submodules alike) that keeps its layer's half of `DualRotary`'s table."""
    from megatron.core.transformer.attention import SelfAttention

    class PerLayerRopeSelfAttention(SelfAttention):
        def __init__(self, *args, local_rope_layers: tuple[bool, ...], **kwargs):
            super().__init__(*args, **kwargs)
            self.local_rope = local_rope_layers[self.layer_number - 1]  # layer_number: global, from 1

        def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
            if rotary_pos_emb is not None:
                rotary_pos_emb = layer_table(rotary_pos_emb, local=self.local_rope)
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    return PerLayerRopeSelfAttention


def edit_gemma3_layer_spec(spec, *, config, settings, transformer_engine: bool):
    spec = edit_gemma2_layer_spec(spec, config=config, settings=settings, transformer_engine=transformer_engine)
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, module=per_layer_rope_attention_class(), params={
        **attention.params, "local_rope_layers": settings.quirks["local_rope_layers"]})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def edit_gemma3_model(model, *, settings) -> None:
    """Final-logit softcap as Gemma 2; the local layers' RoPE next to megatron's (the global one)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    edit_gemma2_model(model, settings=settings)
    global_rotary = model.rotary_pos_emb
    local_rotary = RotaryEmbedding(kv_channels=model.config.kv_channels, rotary_percent=1.0,
                                   rotary_base=settings.quirks["local_rope_theta"], use_cpu_initialization=True,
                                   cp_group=global_rotary.cp_group)
    local_rotary.inv_freq = local_rotary.inv_freq.to(global_rotary.inv_freq.device)
    model.rotary_pos_emb = DualRotary(global_rotary=global_rotary, local_rotary=local_rotary)


GEMMA3_TEXT = register(ModelFamily(
    model_type="gemma3_text", hf_architecture="Gemma3ForCausalLM", weights=GEMMA2_WEIGHTS + QK_NORMS,
    untied_output=LM_HEAD, ignored_hf=ROTARY_BUFFERS,
    architecture=dataclasses.replace(GEMMA2_ARCHITECTURE, qk_norm=True), hf_activation_field="hidden_activation",
    read_config=read_gemma2_config, check_config=check_gemma3_config, read_quirks=read_gemma3_quirks,
    edit_layer_spec=edit_gemma3_layer_spec, edit_model=edit_gemma3_model,
))
