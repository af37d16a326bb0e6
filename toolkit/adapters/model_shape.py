"""A model's shape (toolkit/models/shapes.py) with its family's layer facts: the one reading of a checkpoint's config
into the facts the planner, the layout rules (toolkit/parallel/rules.py `ModelFacts.from_shape`), the model loader
and the checks use.

A config does not say everything a shape needs: whether the MLP is gated (Gemma's GeGLU is, with a GELU) and
whether TP may replicate KV heads (not where q / k norms span the heads: OLMo-2). The adapter family of the
config's `model_type` says it (`Architecture`); a model type dsmt has no adapter for is read as Llama-like (a
SwiGLU activation name means a gated MLP)."""

from __future__ import annotations

from pathlib import Path

from toolkit.models.shapes import ModelShape, read_model_ref, shape_from_fields


def shape_from_config(config: dict, *, name: str) -> ModelShape:
    """Shape from an HF config dict, Llama-like or GPT-2 shaped (a multimodal one's: its language model's)."""
    architecture = _family_architecture(config)  # loads the families first (a multimodal one's is its text's)
    from toolkit.adapters.multimodal import text_model_fields

    config = text_model_fields(config)
    if architecture is None:  # no adapter: read as Llama-like, a SwiGLU activation name meaning a gated MLP
        return shape_from_fields(config, name=name, gated_mlp=_named_gated(config), kv_heads_replicable=True)
    return shape_from_fields(config, name=name, gated_mlp=architecture.gated_mlp,
                             kv_heads_replicable=not architecture.qk_norm_spans_heads, qkv_bias=architecture.qkv_bias,
                             local_layers_only=architecture.local_layers_only)


def load_model_shape(ref: str | Path) -> ModelShape:
    """Shape of `ref`: a built-in name, an HF checkpoint directory, or a path to a config.json."""
    read = read_model_ref(ref)
    return read if isinstance(read, ModelShape) else shape_from_config(read, name=str(ref))


def _family_architecture(config):
    """The layer deltas of the config's adapter family; None when dsmt has no adapter for it. (torch is imported
    only here, when a config is read: a built-in shape needs none.)"""
    from toolkit.adapters.family import get_family, supported_model_types

    model_type = config.get("model_type") if isinstance(config, dict) else None
    return get_family(model_type).architecture if model_type in supported_model_types() else None


def _named_gated(config) -> bool:
    return (config.get("hidden_act", "silu") if isinstance(config, dict) else "silu") in ("silu", "swiglu")


def shape_of_hf_config(hf_config) -> ModelShape:
    """The shape of a loaded transformers config (the adapters' `load_hf_config`), read by the same function as a
    config.json: what the model loader's layout rules and the checks see is one reading."""
    return shape_from_config(hf_config.to_dict(), name=hf_config.model_type)


def model_facts(hf_config, *, vocab_pad_multiple: int):
    """What of a loaded checkpoint's model a layout must divide (toolkit/parallel/rules.py `ModelFacts`)."""
    from toolkit.parallel.rules import ModelFacts

    return ModelFacts.from_shape(shape_of_hf_config(hf_config), vocab_multiple=vocab_pad_multiple)
