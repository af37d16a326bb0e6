"""Tiny random HF checkpoints built from a config and saved with `save_pretrained` (demo, tests, benchmarks).
Nothing is downloaded: the weights are random, norm weights included (so a wrong norm mapping shows in logits)."""

from __future__ import annotations

from pathlib import Path

import torch

# Small but with every feature that breaks converters: GQA (4 query heads per KV head), a vocabulary that no TP
# divides evenly (250 -> padded to 256), several layers for PP.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=250, max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)

_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}


def tiny_config(model_type: str = "llama", **overrides):
    import transformers

    fields = {**TINY_LLAMA, **overrides}
    if model_type == "mistral":
        fields.setdefault("sliding_window", None)
    return getattr(transformers, _CONFIG_CLASSES[model_type])(**fields)


def make_tiny_checkpoint(path: Path, *, model_type: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                         max_shard_size: str | None = None, **overrides) -> Path:
    """Save a randomly initialised tiny model of `model_type` to `path` and return the path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF initialises norms to 1: randomise so a misplaced norm is visible
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    _save_tiny_tokenizer(path, vocab_size=model.config.vocab_size)
    return Path(path)


def _save_tiny_tokenizer(path: Path, *, vocab_size: int) -> None:
    """A character-level tokenizer (letters, digits, space, punctuation) over `vocab_size` ids, saved in HF format
    (no download); the ids past the characters are unused filler tokens."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?'\"-:;\n")
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    extra = [f"w{i}" for i in range(vocab_size - len(vocab))]
    vocab.update({tok: len(specials) + len(words) + i for i, tok in enumerate(extra)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # characters back together, no spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def save_random_init(path: Path, *, config_fields: dict, seed: int) -> Path:
    """A randomly initialised HF model of an inline config (job specs with `model.config`), saved with
    save_pretrained, plus the tiny word tokenizer when the vocabulary is large enough for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config_fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if config.vocab_size >= 64:
        _save_tiny_tokenizer(path, vocab_size=config.vocab_size)
    return Path(path)
