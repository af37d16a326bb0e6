"""Model shapes: the handful of numbers that sizing and checking need, read without loading any weights.

The planner (`dsmt plan`) and the job-spec checks (`dsmt check`) need the same facts about a model: hidden size,
layers, heads, KV heads, FFN width, vocabulary, tied embeddings. They come from three places:
  * an HF checkpoint directory or a bare `config.json` of a Llama-like family (llama, mistral, qwen2, ...),
  * a GPT-2 shaped config (`n_embd`, `n_layer`, `n_head`),
  * a built-in table of well-known models (`llama3-70b`), so planning works with no checkpoint on disk.
The adapters (`toolkit/adapters`) do the full config translation for conversion; this module only reads shapes.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

from toolkit.errors import DsmtError


class ModelShapeError(DsmtError):
    """A model reference that cannot be turned into a shape (missing file, unknown name, missing fields)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    gated_mlp: bool  # SwiGLU-style MLP: three [h, ffn] matrices instead of two
    max_position_embeddings: int = 4096
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is num_experts experts of width
    # moe_ffn_hidden_size, moe_topk of them per token, and a router [num_experts, hidden]. 0: a dense model.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    # HF attn_logit_softcapping (Gemma 2): only megatron's local attention reproduces it, so the s x s scores are stored.
    attention_softcap: float | None = None
    # False: tp must divide num_kv_heads (OLMo-2's q / k norms span the heads; the family's `qk_norm_spans_heads`)
    kv_heads_replicable: bool = True

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expert_params_per_layer(self) -> int:
        """The experts' weights of one layer (0 for a dense model); expert parallelism splits them over ep ranks."""
        return self.num_experts * (3 if self.gated_mlp else 2) * self.hidden_size * self.moe_ffn_hidden_size

    def num_params(self) -> int:
        """Parameter count of the unpadded model (norm weights included, biases ignored)."""
        return self.params_per_layer() * self.num_layers + self.embedding_params() + self.hidden_size

    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.kv_channels
        attention = h * d * (self.num_attention_heads + 2 * self.num_kv_heads) + self.num_attention_heads * d * h
        if self.is_moe:
            mlp = self.expert_params_per_layer() + self.num_experts * h  # experts + router
        else:
            mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden_size
        return attention + mlp + 2 * h  # two norms

    def embedding_params(self) -> int:
        """Input embedding plus output layer (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)


def _llama_like(name, h, layers, heads, kv, ffn, vocab, *, tied=False, max_pos=8192):
    return ModelShape(name, h, layers, heads, kv, ffn, vocab, tied, True, max_pos)


# Published shapes (config.json of each release).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in [
        _llama_like("llama2-7b", 4096, 32, 32, 32, 11008, 32000, max_pos=4096),
        _llama_like("llama2-13b", 5120, 40, 40, 40, 13824, 32000, max_pos=4096),
        _llama_like("llama2-70b", 8192, 80, 64, 8, 28672, 32000, max_pos=4096),
        _llama_like("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
        _llama_like("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
        _llama_like("llama3-405b", 16384, 126, 128, 8, 53248, 128256),
        _llama_like("llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, tied=True),
        _llama_like("mistral-7b", 4096, 32, 32, 8, 14336, 32000, max_pos=32768),
        _llama_like("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, max_pos=32768),
        _llama_like("qwen2-72b", 8192, 80, 64, 8, 29568, 152064, max_pos=32768),
        # toolkit/demo/tiny.py's TINY_LLAMA (its character tokenizer fits the 250 ids): CPU pretraining tests.
        _llama_like("tiny-llama", 64, 4, 8, 2, 96, 250, max_pos=128),
        # GPT-3 175B (Brown et al. 2020) and the 1T configuration of Narayanan et al. 2021, Table 1.
        ModelShape("gpt3-175b", 12288, 96, 96, 96, 4 * 12288, 51200, True, False, 2048),
        ModelShape("gpt-1t", 25600, 128, 160, 160, 4 * 25600, 51200, True, False, 2048),
        # Mixtral-8x7B-v0.1 and Qwen3-30B-A3B (config.json of the releases).
        ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, False, True, 32768,
                   num_experts=8, moe_topk=2, moe_ffn_hidden_size=14336),
        ModelShape("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, False, True, 40960, head_dim=128,
                   num_experts=128, moe_topk=8, moe_ffn_hidden_size=768),
    ]
}


# Megatron's default padding unit (make_vocab_size_divisible_by). dsmt pads to a multiple of it alone, not of it
# times tp as Megatron-LM does: the padded vocabulary, and so a converted checkpoint, is then the same for every
# power-of-two tp up to 128, which is what lets one checkpoint load at any layout.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, *, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """The vocabulary rounded up to `multiple` rows (the extra rows are zeros, dropped on export)."""
    return -(-vocab_size // multiple) * multiple


def load_model_shape(ref: str | Path) -> ModelShape:
    """Shape of `ref`: a built-in name, an HF checkpoint directory, or a path to a config.json."""
    text = str(ref)
    if text in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[text]
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        near = difflib.get_close_matches(text, BUILTIN_SHAPES, n=3)
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        raise ModelShapeError(
            f"model {text!r} is neither a built-in shape nor an existing checkpoint directory or config.json.{hint} "
            f"Built-in shapes: {', '.join(sorted(BUILTIN_SHAPES))}."
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelShapeError(f"cannot read {path} as JSON ({err}); pass a valid HF config.json") from err
    return shape_from_config(config, name=str(ref))


def shape_from_config(config: dict, *, name: str) -> ModelShape:
    """Shape from an HF config dict, Llama-like or GPT-2 shaped."""
    if "n_embd" in config:  # GPT-2 naming
        h = _field(config, "n_embd", name)
        heads = _field(config, "n_head", name)
        return ModelShape(
            name=name, hidden_size=h, num_layers=_field(config, "n_layer", name), num_attention_heads=heads,
            num_kv_heads=heads, ffn_hidden_size=config.get("n_inner") or 4 * h,
            vocab_size=_field(config, "vocab_size", name), tied_embeddings=config.get("tie_word_embeddings", True),
            gated_mlp=False, max_position_embeddings=config.get("n_positions", 1024),
        )
    heads = _field(config, "num_attention_heads", name)
    return ModelShape(
        name=name, hidden_size=_field(config, "hidden_size", name), num_layers=_field(config, "num_hidden_layers", name),
        num_attention_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        ffn_hidden_size=_field(config, "intermediate_size", name), vocab_size=_field(config, "vocab_size", name),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), gated_mlp=_gated_mlp(config),
        max_position_embeddings=config.get("max_position_embeddings", 4096), head_dim=config.get("head_dim"),
        attention_softcap=_attention_softcap(config),
        kv_heads_replicable=not _family_architecture(config).qk_norm_spans_heads, **_moe_fields(config),
    )


def _attention_softcap(config: dict) -> float | None:
    """Gemma 2's attn_logit_softcapping (Gemma 3 configs carry the field, but transformers does not apply it)."""
    return (config.get("attn_logit_softcapping") or None) if config.get("model_type") == "gemma2" else None


def _moe_fields(config: dict) -> dict:
    """Mixtral names the experts `num_local_experts` and their width `intermediate_size`; Qwen3-MoE `num_experts`
    (transformers 5 writes `num_local_experts`) and `moe_intermediate_size`."""
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if not experts:
        return {}
    return {"num_experts": experts, "moe_topk": config.get("num_experts_per_tok", 2),
            "moe_ffn_hidden_size": config.get("moe_intermediate_size") or config["intermediate_size"]}


def _family_architecture(config: dict):
    """The layer deltas of the config's adapter family (Llama's defaults when dsmt has no adapter for it)."""
    from toolkit.adapters.family import Architecture, get_family, supported_model_types

    model_type = config.get("model_type")
    return get_family(model_type).architecture if model_type in supported_model_types() else Architecture()


def _gated_mlp(config: dict) -> bool:
    """The family's own answer when dsmt has an adapter for it (Gemma's GeGLU is gated with a GELU), else a
    SwiGLU activation name says so."""
    from toolkit.adapters.family import supported_model_types

    if config.get("model_type") in supported_model_types():
        return _family_architecture(config).gated_mlp
    return config.get("hidden_act", "silu") in ("silu", "swiglu")


def _field(config: dict, key: str, name: str) -> int:
    if key not in config:
        raise ModelShapeError(f"config of {name!r} has no {key!r}; it is not a Llama-like or GPT-2 shaped config")
    return config[key]
