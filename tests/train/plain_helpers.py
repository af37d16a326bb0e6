"""Tiny models without a megatron-core adapter and their data: for the plain engine's tests
(tests/train/plain/test_train_plain.py) and for the validation of plain models
(tests/train/job/test_train_task_validation.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

WORDS = "the a cat dog sat on mat ran fast slow big small red blue green house tree bird sky sun".split()


def distilbert(root: Path, *, head: str, **config) -> Path:
    import transformers

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    torch.manual_seed(0)
    # Dropout off: the parity reference must compute exactly what the ranks compute.
    settings = dict(vocab_size=len(vocab), dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32,
                    dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    getattr(transformers, f"DistilBertFor{head}")(transformers.DistilBertConfig(**settings, **config)).save_pretrained(root)
    transformers.DistilBertTokenizer(vocab=vocab).save_pretrained(root)
    return root


def write_image_folder(root: Path, *, per_class: int = 8) -> Path:
    """3 classes of 16x16 PNGs: a class colour plus noise, so the model can learn."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(("circle", "square", "triangle")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            base = np.zeros((16, 16, 3)) + 60
            base[..., label] = 200
            pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def write_text(path: Path, *, count: int = 20) -> Path:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        words = rng.choices(WORDS, k=rng.randint(4, 24))
        rows.append({"text": " ".join(words), "score": words.count("cat") / len(words) + 0.1 * len(words)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
