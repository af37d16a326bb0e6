"""Pretraining a built-in shape (`model.builtin`): megatron-core initialises the weights, nothing is loaded.

A shape (`toolkit/models/shapes.py`) carries sizes only; the rest of an HF config comes from the release table below.
Rank 0 writes `<output_dir>/init-hf/` with that config.json and the `data.tokenizer` files, never weights (a 70B
random init is not saved to disk first); every rank then builds its chunks with megatron's init method
(`toolkit.convert.chunks.init_model_chunks`), and the export writes final-mcore / final-hf as for a fine-tune.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError, Problem
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape

# HF config fields of each release that the shape table does not carry (the releases' config.json).
# initializer_range is HF's init std; megatron's init_method_std is set to it.
_LLAMA = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "initializer_range": 0.02}
RELEASE_FIELDS: dict[str, dict] = {
    "tiny-llama": {**_LLAMA, "rope_theta": 10000.0},
    "llama2-7b": {**_LLAMA, "rope_theta": 10000.0},
    "llama2-13b": {**_LLAMA, "rope_theta": 10000.0},
    "llama2-70b": {**_LLAMA, "rope_theta": 10000.0},
    "llama3-8b": {**_LLAMA, "rope_theta": 500000.0},
    "llama3-70b": {**_LLAMA, "rope_theta": 500000.0},
    "llama3-405b": {**_LLAMA, "rope_theta": 500000.0},
    "llama3.2-1b": {**_LLAMA, "rope_theta": 500000.0},
    # v0.2/v0.3: no sliding window (v0.1 has 4096, which the mistral family reproduces per layer).
    "mistral-7b": {**_LLAMA, "model_type": "mistral", "rope_theta": 1000000.0, "sliding_window": None},
    "qwen2-7b": {**_LLAMA, "model_type": "qwen2", "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen2-72b": {**_LLAMA, "model_type": "qwen2", "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}


def hf_config_fields(name: str) -> dict:
    """The HF config (as `AutoConfig.for_model` fields, model_type included) of built-in shape `name`."""
    if name not in RELEASE_FIELDS:
        trainable = ", ".join(sorted(RELEASE_FIELDS))
        raise DsmtError(f"model.builtin={name!r} cannot be pretrained by `dsmt train`: it has no Llama-like HF "
                        f"config (GPT-style shapes have no megatron-core adapter here); trainable shapes: {trainable}")
    shape: ModelShape = BUILTIN_SHAPES[name]
    return {**RELEASE_FIELDS[name], "hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_kv_heads,
            "intermediate_size": shape.ffn_hidden_size, "vocab_size": shape.vocab_size,
            "max_position_embeddings": shape.max_position_embeddings, "tie_word_embeddings": shape.tied_embeddings,
            **({"head_dim": shape.head_dim} if shape.head_dim else {})}


def hf_config(name: str):
    from transformers import AutoConfig

    fields = hf_config_fields(name)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def builtin_problems(spec, *, tokenizer=None) -> list[Problem]:
    """Why `spec.model.builtin` cannot be pretrained as asked (empty when it can). `tokenizer`: the loaded
    `data.tokenizer` when the caller has it; otherwise it is loaded here when set."""
    name = spec.model.builtin
    try:
        hf_config_fields(name)
    except DsmtError as err:
        return [Problem("error", "builtin_not_trainable", str(err), "use one of the trainable shapes, or model.path")]
    vocab_size = BUILTIN_SHAPES[name].vocab_size
    if spec.data.tokenizer is None:  # text data without one is `dsmt check`'s builtin_needs_tokenizer
        return []
    if tokenizer is None:
        from toolkit.data import load_tokenizer

        try:
            tokenizer = load_tokenizer(data=spec.data, model_path=None)
        except DsmtError as err:
            return [Problem("error", "tokenizer", str(err), "")]
    return tokenizer_fit_problems(tokenizer=tokenizer, vocab_size=vocab_size, where=f"model.builtin={name}",
                                  tokenizer_ref=spec.data.tokenizer)


def tokenizer_fit_problems(*, tokenizer, vocab_size: int, where: str, tokenizer_ref: str) -> list[Problem]:
    size = len(tokenizer)  # added tokens included: they are ids the data can contain
    if size <= vocab_size:
        return []
    return [Problem("error", "tokenizer_vocab",
                    f"data.tokenizer={tokenizer_ref} has {size} tokens but {where} has vocab_size={vocab_size}: "
                    f"ids {vocab_size}..{size - 1} would have no embedding row",
                    f"use a tokenizer with at most {vocab_size} tokens (the model family's own), or a model whose "
                    f"vocab_size is >= {size}")]


def require_trainable(spec) -> None:
    problems = [p for p in builtin_problems(spec) if p.severity == "error"]
    if problems:
        raise DsmtError("\n".join(f"[{p.rule}] {p.message}" + (f"; fix: {p.fix}" if p.fix else "") for p in problems))


def write_init_dir(init_dir: Path, *, spec) -> Path:
    """config.json for the shape plus the data.tokenizer files, no weights; written aside, then renamed into place,
    so a crash never leaves a config without its tokenizer (rank 0 only)."""
    from toolkit.convert.checkpoint import atomic_output_dir

    with atomic_output_dir(Path(init_dir), overwrite=True) as temp_dir:
        if spec.data.tokenizer is not None:
            from toolkit.data import load_tokenizer

            load_tokenizer(data=spec.data, model_path=None).save_pretrained(temp_dir)
        hf_config(spec.model.builtin).save_pretrained(temp_dir)
    return Path(init_dir)


def init_chunks(*, spec, hf_dir: Path, layout, params_dtype, zero3_config: dict | None = None):
    """This rank's chunks from megatron-core's initialisation, std = the config's initializer_range (built
    partitioned with a ZeRO-3 `zero3_config`)."""
    from toolkit.convert.chunks import init_model_chunks
    from toolkit.spec.layout import spec_attention

    std = hf_config(spec.model.builtin).initializer_range
    return init_model_chunks(hf_dir=hf_dir, layout=layout, params_dtype=params_dtype, init_method_std=std,
                             seed=spec.training.seed, vocab_pad_multiple=spec.model.make_vocab_size_divisible_by,
                             recompute=spec.training.recompute, attention=spec_attention(spec),
                             zero3_config=zero3_config, fusions=spec.training.fusions)
