"""Tiny random HF checkpoints shared by the adapter tests (built once per session, saved with save_pretrained)."""

import pytest

from toolkit.tiny import make_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

VARIANTS = {
    "llama": dict(model_type="llama"),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3_rope": dict(model_type="llama", rope_parameters=LLAMA3_ROPE, seed=3),
    "qwen2": dict(model_type="qwen2", seed=1),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True, seed=4),
    "mistral": dict(model_type="mistral", seed=2),
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-hf")
    return {name: make_tiny_checkpoint(root / name, **kwargs) for name, kwargs in VARIANTS.items()}
