"""pytest (prepend import mode) puts this directory on sys.path for every test below it: the tests in
tests/train/{job,engine,checkpoint,lora,plain} import the helpers here by name (train_helpers, reference*,
fault_helpers); tests/ranks.py gives ranks that run a test file the same path. `tiny_llama`: tests/conftest.py."""

import pytest

from toolkit.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train-hf-tied") / "llama", tie_word_embeddings=True, seed=5)
