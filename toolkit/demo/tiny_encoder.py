"""Tiny random BERT checkpoints (masked LM or sequence classification / regression) with a WordPiece tokenizer,
saved with `save_pretrained`, for tests and examples. Nothing is downloaded. Norm weights, biases and the classifier
are randomised so that a misplaced norm, bias or head shows in the outputs."""

from __future__ import annotations

import string
from pathlib import Path

import torch

# Small, with what breaks converters: several heads (per-head QKV interleave), a vocabulary no TP divides
# (250 -> padded to 256), 4 layers for PP, 2 token types. Dropout 0: parity tests compare exact numbers.
TINY_BERT = dict(vocab_size=250, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=128, type_vocab_size=2, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12, pad_token_id=0)
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_CLASSES = ("BertForMaskedLM", "BertForSequenceClassification")
# The heads the tests check (make_tiny_bert keyword arguments): tied MLM, regression, 3 classes.
TINY_BERT_HEADS = {"mlm": dict(architecture="BertForMaskedLM"),
                   "regression": dict(architecture="BertForSequenceClassification", num_labels=1, seed=1),
                   "classes3": dict(architecture="BertForSequenceClassification", num_labels=3, seed=2)}


def make_tiny_bert(path: Path, *, architecture: str = "BertForMaskedLM", num_labels: int = 1, seed: int = 0,
                   **overrides) -> Path:
    """Save a random tiny BERT of HF class `architecture` (num_labels: sequence classification only; 1 is
    regression) and its tokenizer to `path`; returns the path."""
    import transformers

    if architecture not in BERT_CLASSES:
        raise ValueError(f"architecture={architecture!r}; one of {BERT_CLASSES}")
    fields = {**TINY_BERT, **overrides}
    if architecture == "BertForSequenceClassification":
        fields["num_labels"] = num_labels
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(transformers.BertConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name == "classifier.weight":  # outputs of order 1 (HF's std 0.02 gives ~0.03)
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(path)
    save_wordpiece_tokenizer(path, vocab_size=model.config.vocab_size)
    return Path(path)


def save_wordpiece_tokenizer(path: Path, *, vocab_size: int) -> None:
    """A lower-casing BERT WordPiece tokenizer over single characters (`a` and the continuation `##a`), digits and
    punctuation, padded with unused filler tokens to `vocab_size` ids: every English word tokenises, letter by
    letter, with no [UNK]."""
    from transformers import BertTokenizerFast

    letters = list(string.ascii_lowercase)
    vocab = SPECIAL_TOKENS + letters + [f"##{c}" for c in letters] + list(string.digits) + list(".,!?'\"-:;")
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True).save_pretrained(path)
