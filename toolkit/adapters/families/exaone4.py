"""EXAONE 4.0 (HF `Exaone4ForCausalLM`): OLMo-2's norm placement (olmo2.py: no pre-norm; each layer is
h = x + post_attention_layernorm(attention(x)), out = h + post_feedforward_layernorm(mlp(h))) with Qwen3's q / k
norms (an RMSNorm over each head, before RoPE: megatron's qk_layernorm, replicated over TP) and hybrid attention:

* `sliding_attention` layers (`layer_types`, from `sliding_window_pattern`: 3 local then 1 global in EXAONE-4.0-32B)
  see a window of `sliding_window` tokens (megatron's window_size / window_attn_skip_freq, toolkit/adapters/window.py)
  and rotate q / k with RoPE;
* `full_attention` layers see the whole sequence and, when the model has a sliding window, use no positional
  encoding at all (NoPE: HF applies RoPE only `if self.sliding_window is None or self.is_sliding`). That is
  megatron's `no_rope_freq` as a per-layer list (1 = no RoPE), which megatron's attention reads by its global
  layer number, so every pipeline stage skips the right layers, local and Transformer Engine attention alike;
* without a sliding window (`sliding_window: null`; EXAONE-4.0-1.2B has no hybrid attention) every layer is global
  and every layer uses RoPE.

One RoPE for all layers (llama3-scaled in the releases, through the shared translation). Tied or untied embeddings
as the checkpoint says (1.2B ties them, 32B does not). In bf16 HF's Exaone4RMSNorm casts the normalised value back
before the weight and dsmt's norms multiply in fp32 (as for every Llama-like family): fp32 logits match exactly,
bf16 ones within bf16 rounding."""

from __future__ import annotations

import dataclasses

from toolkit.adapters.config_checks import attention_dropout_problems, layer_type_problems
from toolkit.adapters.family import Architecture, ModelFamily, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.olmo2 import OLMO2_WEIGHTS, edit_olmo2_layer_spec
from toolkit.adapters.families.qwen3 import QK_NORMS
from toolkit.adapters.hf_config import rope_settings
from toolkit.adapters.window import SLIDING, window_fields

# OLMo-2's rows with its whole-projection q / k norms (column-parallel) replaced by Qwen3's per-head ones (replicated).
_PER_HEAD_NORMS = {row.megatron: row for row in QK_NORMS}
EXAONE4_WEIGHTS = tuple(_PER_HEAD_NORMS.get(row.megatron, row) for row in OLMO2_WEIGHTS)


def read_exaone4_config(hf_config) -> dict:
    """The window of the sliding layers and, with a window, no RoPE on the full layers (HF's rule)."""
    fields = window_fields(hf_config)
    if hf_config.sliding_window:
        no_rope = [int(kind != SLIDING) for kind in hf_config.layer_types]
        fields |= {"no_rope_freq": no_rope} if any(no_rope) else {}
    return fields


def check_exaone4_config(hf_config) -> list[str]:
    layer_types = list(getattr(hf_config, "layer_types", None) or ())
    problems = layer_type_problems(hf_config, family="exaone4")
    if not hf_config.sliding_window and SLIDING in layer_types:
        problems.append(f"sliding_window={hf_config.sliding_window} with {SLIDING!r} layers: transformers' "
                        "sliding-window mask needs a window and fails without one; set sliding_window (EXAONE-4.0-32B: "
                        "4096), or make every layer 'full_attention' (EXAONE-4.0-1.2B)")
    problems += attention_dropout_problems(hf_config, family="exaone4", released="EXAONE 4.0 releases set 0.0")
    _, _, rope_problem = rope_settings(hf_config)
    return problems + ([rope_problem] if rope_problem else [])


def edit_exaone4_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """OLMo-2's post-norms without pre-norms (olmo2.py), keeping the spec's own per-head q / k norms."""
    per_head = spec.submodules.self_attention.submodules
    spec = edit_olmo2_layer_spec(spec, config=config, settings=settings, transformer_engine=transformer_engine)
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, q_layernorm=per_head.q_layernorm, k_layernorm=per_head.k_layernorm))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


EXAONE4 = register(ModelFamily(
    model_type="exaone4", hf_architecture="Exaone4ForCausalLM", weights=EXAONE4_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qk_norm=True), read_config=read_exaone4_config,
    check_config=check_exaone4_config, edit_layer_spec=edit_exaone4_layer_spec,
))
