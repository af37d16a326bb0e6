"""Dataset repository folders (as `huggingface-cli download --repo-type dataset` leaves them) and dataset names in
the local Hugging Face cache, read offline (toolkit/data/sources.py)."""

from __future__ import annotations

import datasets
import pytest

from toolkit.data.sources import load_records, source_identity
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

README_CONFIGS = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/*.jsonl
- config_name: fr
  data_files:
  - split: train
    path: fr/*.jsonl
---
# two languages
"""


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


@pytest.fixture
def repo_folder(tmp_path):
    folder = tmp_path / "tiny-stories"
    write_parquet(folder / "data" / "train-00000-of-00001.parquet", [{"text": "ab"}, {"text": "cd"}, {"text": "e"}])
    write_parquet(folder / "data" / "test-00000-of-00001.parquet", [{"text": "zz"}])
    (folder / "README.md").write_text("# a dataset card without configs\n")
    return folder


def test_repository_folder_splits_from_file_names(repo_folder, cache_dir):
    train = load_records(data=DataSpec(path=str(repo_folder)), cache_dir=cache_dir)
    test = load_records(data=DataSpec(path=str(repo_folder), split="test"), cache_dir=cache_dir)
    assert train["text"] == ["ab", "cd", "e"] and test["text"] == ["zz"]
    with pytest.raises(DsmtError, match=r"dataset repository folder .*data.split='validation'.*train.*test"):
        load_records(data=DataSpec(path=str(repo_folder), split="validation"), cache_dir=cache_dir)


def test_repository_folder_configs_from_the_readme(tmp_path, write_jsonl, cache_dir):
    folder = tmp_path / "bilingual"
    for language, texts in (("en", ["one", "two"]), ("fr", ["un"])):
        (folder / language).mkdir(parents=True)
        (folder / language / "part.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    (folder / "README.md").write_text(README_CONFIGS)
    assert load_records(data=DataSpec(path=str(folder), config="fr"), cache_dir=cache_dir)["text"] == ["un"]
    assert load_records(data=DataSpec(path=str(folder), config="en"), cache_dir=cache_dir)["text"] == ["one", "two"]


def test_folder_without_data_files_is_named(tmp_path, cache_dir):
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    (tmp_path / "empty" / "notes" / "readme.md").write_text("nothing")
    with pytest.raises(DsmtError, match=r"neither a datasets.save_to_disk output .* nor a dataset repository folder"):
        load_records(data=DataSpec(path=str(tmp_path / "empty")), cache_dir=cache_dir)


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """A hub cache holding dataset `org/tiny` as the hub CLI leaves it (refs/main -> a snapshot), offline."""
    import huggingface_hub.constants

    root, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = root / "datasets--org--tiny"
    write_parquet(repo / "snapshots" / commit / "data" / "train-00000-of-00001.parquet",
                  [{"instruction": "add", "input": "ab", "output": "c"}])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))  # read at import: set both
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_cached_dataset_name_loads_offline(offline_hub_cache, cache_dir):
    records = load_records(data=DataSpec(path="org/tiny", type="alpaca"), cache_dir=cache_dir)
    assert records["output"] == ["c"]
    identity = source_identity("org/tiny")  # the cache key sees the snapshot's files
    assert identity[0] == ["hub", "org/tiny"] and identity[1][0] == "data/train-00000-of-00001.parquet"


def test_name_missing_from_the_cache_is_named_offline(offline_hub_cache, cache_dir):
    with pytest.raises(DsmtError, match=r"'org/other' is not a local file .* not in the local Hugging Face cache"):
        load_records(data=DataSpec(path="org/other"), cache_dir=cache_dir)
