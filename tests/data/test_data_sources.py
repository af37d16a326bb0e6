"""load_records: every accepted source, and the errors for the ones it refuses."""

import json

import pytest
from data_helpers import EXAMPLES

from toolkit.data import load_records
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

TEXTS = ["the cat sat", "a dog ran", "birds sing"]


def _texts(records, field="text"):
    return list(records[field])


def test_jsonl(write_jsonl, cache_dir):
    path = write_jsonl([{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    assert _texts(load_records(data=DataSpec(path=path), cache_dir=cache_dir)) == TEXTS


def test_json_list_of_records(tmp_path, cache_dir):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": t} for t in TEXTS]))
    assert _texts(load_records(data=DataSpec(path=str(path)), cache_dir=cache_dir)) == TEXTS


def test_csv_and_parquet(tmp_path, cache_dir):
    import datasets

    table = datasets.Dataset.from_dict({"body": TEXTS})
    table.to_csv(str(tmp_path / "d.csv"))
    table.to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.csv", "d.parquet"):
        records = load_records(data=DataSpec(path=str(tmp_path / name), text_field="body"), cache_dir=cache_dir)
        assert _texts(records, "body") == TEXTS


def test_plain_text_one_record_per_line(tmp_path, cache_dir):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    assert _texts(load_records(data=DataSpec(path=str(path)), cache_dir=cache_dir)) == TEXTS


def test_format_overrides_extension_and_gz_is_looked_through(tmp_path, cache_dir):
    import gzip

    odd = tmp_path / "records.data"
    odd.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert _texts(load_records(data=DataSpec(path=str(odd), format="jsonl"), cache_dir=cache_dir)) == TEXTS
    packed = tmp_path / "records.jsonl.gz"
    packed.write_bytes(gzip.compress(odd.read_bytes()))
    assert _texts(load_records(data=DataSpec(path=str(packed)), cache_dir=cache_dir)) == TEXTS


def test_split_slicing_on_a_file(write_jsonl, cache_dir):
    path = write_jsonl([{"text": t} for t in TEXTS])
    assert _texts(load_records(data=DataSpec(path=path, split="train[:2]"), cache_dir=cache_dir)) == TEXTS[:2]
    assert _texts(load_records(data=DataSpec(path=path, split="validation"), cache_dir=cache_dir)) == TEXTS


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "flat"))
    assert _texts(load_records(data=DataSpec(path=str(tmp_path / "flat")))) == TEXTS
    both = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                                 "test": datasets.Dataset.from_dict({"text": ["held out"]})})
    both.save_to_disk(str(tmp_path / "dict"))
    assert _texts(load_records(data=DataSpec(path=str(tmp_path / "dict"), split="test"))) == ["held out"]
    with pytest.raises(DsmtError, match=r"data.split='dev'.*available splits: train, test"):
        load_records(data=DataSpec(path=str(tmp_path / "dict"), split="dev"))


def test_shipped_examples_load(cache_dir):
    stories = load_records(data=DataSpec(path=str(EXAMPLES / "tiny_stories.jsonl")), cache_dir=cache_dir)
    chats = load_records(data=DataSpec(path=str(EXAMPLES / "tiny_chat.jsonl"), messages_field="messages"),
                         cache_dir=cache_dir)
    prompts = load_records(data=DataSpec(path=str(EXAMPLES / "tiny_prompts.jsonl"), prompt_field="prompt",
                                         completion_field="completion"), cache_dir=cache_dir)
    assert 300 <= len(stories) <= 600 and 45 <= len(chats) <= 60 and 45 <= len(prompts) <= 60


def test_missing_file_names_path_and_fix(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DsmtError, match=r"nope\.jsonl.*does not exist.*save_to_disk directory"):
        load_records(data=DataSpec(path=missing))


def test_unknown_extension_lists_valid(tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_text("x")
    with pytest.raises(DsmtError, match=r"'\.xlsx' is not a known data format; valid: \.jsonl, \.json, \.csv"):
        load_records(data=DataSpec(path=str(path)))


def test_missing_field_names_fields_present(write_jsonl, cache_dir):
    path = write_jsonl([{"body": "x", "id": 1}])
    with pytest.raises(DsmtError, match=r"no field 'text', which data.type=text reads; fields present: body, id; set data.type .* or data.text_field"):
        load_records(data=DataSpec(path=path), cache_dir=cache_dir)
    with pytest.raises(DsmtError, match=r"no field 'q', 'a'"):
        load_records(data=DataSpec(path=path, prompt_field="q", completion_field="a"), cache_dir=cache_dir)


def test_empty_dataset(tmp_path, cache_dir):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "header.csv").write_text("text\n")
    for name in ("empty.jsonl", "header.csv"):
        with pytest.raises(DsmtError, match=r"empty file|has no records"):
            load_records(data=DataSpec(path=str(tmp_path / name)), cache_dir=cache_dir)


@pytest.mark.parametrize("name, content, said", [
    # a blank line before it: pyarrow's "row 1" (from 0, blank lines skipped) would point elsewhere
    ("broken.jsonl", '{"text": "ok"}\n\n{"text": "abc"\n{"text": "z"}\n', "line 3 is not valid JSON (Expecting ',' "
     "delimiter at column 15): '{\"text\": \"abc\"'; fix that line (a JSON-lines file holds one whole JSON object per "
     "line)"),
    ("array.jsonl", '{"text": "ok"}\n["a"]\n', "line 2 is an array, not a JSON object: '[\"a\"]'; fix that line"),
    ("records.json", '[\n {"text": "ok"},\n {"text": "abc"\n]\n', "line 4 is not valid JSON (Expecting ',' delimiter "
     "at column 1): ']'; fix the JSON there"),
])
def test_a_malformed_json_line_is_named_by_its_line(tmp_path, cache_dir, capfd, name, content, said):
    from toolkit.data.sources import RecordsError

    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(RecordsError) as refused:
        load_records(data=DataSpec(path=str(path)), cache_dir=cache_dir)
    assert refused.value.rule == "data_json_line" and said in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value) and " row " not in capfd.readouterr().err  # one line, no pyarrow count


def test_hub_name_offline_fails_clearly(monkeypatch, cache_dir):
    import datasets.config
    import huggingface_hub.constants

    # `datasets` reads HF_HUB_OFFLINE when imported, so set its parsed copies as well as the variable.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DsmtError, match=r"'roneneldan/TinyStories' is not a local file .* not in the local Hugging Face cache .*huggingface-cli download --repo-type dataset roneneldan/TinyStories"):
        load_records(data=DataSpec(path="roneneldan/TinyStories"), cache_dir=cache_dir)
