import pytest

from toolkit.demo.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """The tiny GQA Llama (vocab 250, padded to 256) with its word-level tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train-hf") / "llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train-hf-tied") / "llama", tie_word_embeddings=True, seed=5)
