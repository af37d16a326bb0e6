"""Refusals several families share, worded once: attention dropout a family trains without, layer kinds it does not
know, and the RoPE kinds whose frequencies a family may read from transformers' own rotary module."""

from __future__ import annotations

from toolkit.adapters.window import FULL, SLIDING

# RoPE kinds whose frequencies transformers fixes when it builds the rotary module (`dynamic` and `longrope` change
# them per forward, so they cannot be read once: OLMo-3 and GPT-OSS read theirs from transformers' module).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def static_rope_problems(rope: dict, *, family: str, field: str, released: str) -> list[str]:
    """A family that reads its RoPE from transformers' own rotary module once (OLMo-3, GPT-OSS) refuses kinds whose
    frequencies change per forward, and a partial rotary (it rotates whole heads); `field` names where the RoPE
    parameters sit ("rope_parameters" or "rope_parameters.full_attention"), `released` what the releases use."""
    problems = []
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        problems.append(f"{field}.rope_type={rope_type!r}: the {family} adapter reproduces the RoPE kinds with fixed "
                        f"frequencies ({', '.join(STATIC_ROPE_TYPES)}; {released})")
    partial = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0:
        problems.append(f"{field}.partial_rotary_factor={partial}: the {family} adapter rotates the whole head; use "
                        "1.0 (as released)")
    return problems


def attention_dropout_problems(hf_config, *, family: str, released: str) -> list[str]:
    """A family that trains without attention dropout refuses a config asking for it; `released` says what the
    releases set ("OLMo-2 releases set 0.0")."""
    dropout = float(getattr(hf_config, "attention_dropout", 0.0) or 0.0)
    if not dropout:
        return []
    return [f"attention_dropout={dropout}: the {family} adapter trains without dropout ({released}); set it to 0.0 "
            "in config.json"]


def layer_type_problems(hf_config, *, family: str) -> list[str]:
    """`layer_types` entries other than sliding and full attention (chunked, linear attention...)."""
    unknown = sorted(set(getattr(hf_config, "layer_types", None) or ()) - {SLIDING, FULL})
    if not unknown:
        return []
    return [f"layer_types {unknown}: the {family} adapter knows {SLIDING!r} and {FULL!r}"]
