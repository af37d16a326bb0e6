"""SmolLM3 (HF `SmolLM3ForCausalLM`, SmolLM3-3B): the Llama layer, tied embeddings, and NoPE layers: transformers
skips RoPE on the layers whose `no_rope_layers` entry is 0 (every 4th layer as released).

megatron-core has the same switch, `no_rope_freq` (one entry per layer, 1 = skip RoPE; `no_rope_layers` inverted).
`Attention.forward` reads it at the attention's global 1-based `layer_number`, so each pipeline stage skips its
own layers' RoPE; local and Transformer Engine layers share that forward.

Its optional sliding window (`use_sliding_window` + `sliding_window`; transformers marks the NoPE layers as
`sliding_attention` in `layer_types`) is megatron's per-layer window (toolkit/adapters/window.py). A config whose
`layer_types` has sliding layers while `use_sliding_window` is false is refused: transformers' eager / sdpa mask
windows those layers and its flash-attention path does not, so what it means is unclear."""

from __future__ import annotations

from toolkit.adapters.config_checks import layer_type_problems
from toolkit.adapters.family import ModelFamily, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.window import FULL, SLIDING, window_fields


def rope_layers(hf_config) -> list[int]:
    """Per layer, 1 = RoPE, 0 = NoPE (HF `no_rope_layers`, which may be longer than the model)."""
    return [int(bool(uses_rope)) for uses_rope in hf_config.no_rope_layers[:hf_config.num_hidden_layers]]


def read_smollm3_config(hf_config) -> dict:
    no_rope = [1 - uses_rope for uses_rope in rope_layers(hf_config)]
    # attention_dropout (0.0 as released) is on the softmax probabilities in both, as Granite's
    return {"no_rope_freq": no_rope if any(no_rope) else None, **window_fields(hf_config),
            "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0)}


def check_smollm3_config(hf_config) -> list[str]:
    problems = [p.replace("llama adapter", "smollm3 adapter (released SmolLM3 sets it false)")
                for p in check_llama_config(hf_config)]
    flags = list(hf_config.no_rope_layers or [])
    if len(flags) < hf_config.num_hidden_layers or set(flags) - {0, 1}:
        problems.append(f"no_rope_layers={flags}: one 0 (NoPE) or 1 (RoPE) per layer, for all "
                        f"{hf_config.num_hidden_layers} layers")
    layer_types = list(getattr(hf_config, "layer_types", None) or ())
    problems += layer_type_problems(hf_config, family="smollm3")
    if SLIDING in layer_types and not (hf_config.use_sliding_window and hf_config.sliding_window):
        problems.append(f"layer_types has {SLIDING!r} layers while use_sliding_window={hf_config.use_sliding_window}, "
                        f"sliding_window={hf_config.sliding_window}: transformers windows them in eager / sdpa "
                        "attention and not in flash attention; set use_sliding_window: true with a sliding_window, "
                        f"or make those layers {FULL!r}")
    return problems


SMOLLM3 = register(ModelFamily(
    model_type="smollm3", hf_architecture="SmolLM3ForCausalLM", weights=LLAMA_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, read_config=read_smollm3_config, check_config=check_smollm3_config,
))
