"""Fixtures for the data tests: the tiny checkpoint's tokenizer, a private datasets cache, a jsonl writer."""

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from toolkit.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)  # fresh per test: chat tests set a template on it


@pytest.fixture
def cache_dir(tmp_path):
    return str(tmp_path / "hf_cache")


@pytest.fixture
def write_jsonl(tmp_path):
    def write(rows, name="data.jsonl") -> str:
        path = Path(tmp_path) / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    return write
