"""`dsmt data prepare`: every input kind into one Megatron indexed dataset, read back by megatron-core token for token
against the tokenizer called here; the sidecar's counts; each refused input with no file left behind; an earlier
corpus surviving a failed or interrupted run. Worker pools only where they are the point (small chunks, so several
are in flight)."""

import errno
import json
import random

import pytest

from toolkit.cli import main
from toolkit.data import prepare
from toolkit.data.prepare import SIDECAR_SUFFIX, read_sidecar

WORDS = ["the", "cat", "sat", "on", "a", "mat", "Dogs", "run", "fast!", "why?", "x-ray", "42"]


def random_texts(count: int, *, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(count)]
    texts[3] = ""  # empty: skipped and counted, as Megatron skips empty documents
    return texts


@pytest.fixture
def inputs(tmp_path):
    """(paths, texts in order): a jsonl, a parquet, a save_to_disk directory and a hub-style repository folder."""
    import datasets

    texts = {name: random_texts(count, seed=seed) for seed, (name, count) in
             enumerate([("jsonl", 23), ("parquet", 17), ("saved", 11), ("repo", 9)])}
    jsonl = tmp_path / "part.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts["jsonl"])))
    parquet = tmp_path / "part.parquet"
    datasets.Dataset.from_dict({"text": texts["parquet"]}).to_parquet(str(parquet))
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts["saved"], "n": list(range(11))}).save_to_disk(str(saved))
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"text": texts["repo"]}).to_parquet(str(repo / "data/train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"text": ["not the train split"]}).to_parquet(
        str(repo / "data/test-00000-of-00001.parquet"))
    paths = [str(jsonl), str(parquet), str(saved), str(repo)]
    return paths, [t for name in ("jsonl", "parquet", "saved", "repo") for t in texts[name]]


def reference_documents(tokenizer_dir, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in texts if text]


def run_prepare(inputs, *, tokenizer, output, workers=1, extra=()) -> int:
    return main(["data", "prepare", *map(str, inputs), "--tokenizer", str(tokenizer), "--output", str(output),
                 "--workers", str(workers), "--quiet", *extra])


def written(directory) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_every_input_kind_read_back_token_for_token_with_any_workers(inputs, tiny_checkpoint, tmp_path, monkeypatch,
                                                                     capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    paths, texts = inputs
    monkeypatch.setattr(prepare, "CHUNK_TEXTS", 4)  # 15 chunks, so the pool has several in flight
    out = tmp_path / "out"
    out.mkdir()
    for workers in (1, 2):
        assert run_prepare(paths, tokenizer=tiny_checkpoint, output=out / f"w{workers}", workers=workers) == 0
    summary = capsys.readouterr().out
    assert "56 documents (4 empty texts skipped)" in summary and "tokens/s" in summary, summary
    expected = reference_documents(tiny_checkpoint, texts)
    dataset = IndexedDataset(str(out / "w1"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset.document_indices.tolist() == list(range(len(expected) + 1))  # one sequence per document
    for suffix in (".bin", ".idx"):
        assert (out / f"w1{suffix}").read_bytes() == (out / f"w2{suffix}").read_bytes()
    assert written(out) == sorted(f"w{w}{s}" for w in (1, 2) for s in (".bin", ".idx", SIDECAR_SUFFIX))


def test_sidecar_counts_what_was_written(inputs, tiny_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    from toolkit.data.files import digest_file
    from toolkit.data.tokenize import tokenizer_identity

    paths, texts = inputs
    prefix = tmp_path / "corpus"
    assert run_prepare(paths[:2], tokenizer=tiny_checkpoint, output=prefix) == 0
    documents = reference_documents(tiny_checkpoint, texts[:23 + 17])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    meta = read_sidecar(prefix)
    assert meta == json.loads((tmp_path / f"corpus{SIDECAR_SUFFIX}").read_text())
    assert meta == {
        "format": "dsmt-indexed/1", "tokenizer": str(tiny_checkpoint.resolve()),
        "tokenizer_identity": tokenizer_identity(tokenizer), "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer), "eod_id": tokenizer.eos_token_id,
        "max_token_id": max(max(doc) for doc in documents), "num_documents": len(documents),
        "num_tokens": sum(map(len, documents)), "num_skipped_empty": 2, "text_field": "text",
        "inputs": [str(tmp_path / "part.jsonl"), str(tmp_path / "part.parquet")],
        "files": {key: {"size": (tmp_path / f"corpus.{key}").stat().st_size,
                        "xxh3_128": digest_file(tmp_path / f"corpus.{key}")} for key in ("bin", "idx")}}
    assert read_sidecar(tmp_path / "elsewhere") is None


def save_tokenizer_without_eos(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(path)


def bad_case(name: str, tmp_path, tokenizer_dir):
    """(inputs, tokenizer dir, output prefix, what the message must say) for one refused run."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "ab"}\n')
    out = tmp_path / "out" / "corpus"
    if name == "missing input":
        return [tmp_path / "nowhere.jsonl"], tokenizer_dir, out, "nowhere.jsonl does not exist"
    if name == "unknown extension":
        (tmp_path / "data.xml").write_text("<text>ab</text>")
        return [tmp_path / "data.xml"], tokenizer_dir, out, "extension '.xml' is not a known data format"
    if name in ("no text field", "non-string text"):
        bad = tmp_path / "bad.jsonl"
        if name == "no text field":  # a blank line: record 3 is on line 4
            bad.write_text('{"text": "ab"}\n\n{"text": "b"}\n{"body": "cd"}\n')
            return [good, bad], tokenizer_dir, out, "record 3 (line 4) has no field 'text' (or it is null); fields " \
                                                    "present: body"
        # (datasets' json reader, falling back to pandas for a field that changes type, refuses blank lines)
        bad.write_text('{"text": "ab"}\n{"text": "b"}\n{"text": 7}\n')
        said = "record 3 (line 3): field 'text' holds a int (7), not a string"
        return [good, bad], tokenizer_dir, out, said
    if name == "tokenizer does not load":
        (tmp_path / "empty_tokenizer").mkdir()
        return [good], tmp_path / "empty_tokenizer", out, "AutoTokenizer.from_pretrained failed"
    if name == "tokenizer without eos":
        save_tokenizer_without_eos(tmp_path / "no_eos")
        return [good], tmp_path / "no_eos", out, "has no eos_token"
    if name == "output directory missing":
        return [good], tokenizer_dir, tmp_path / "out" / "sub" / "corpus", "sub does not exist; create it"
    empty = tmp_path / "empty.jsonl"  # "zero documents"
    empty.write_text('{"text": ""}\n{"text": ""}\n')
    return [empty], tokenizer_dir, out, "no documents: every one of the 2 records read has an empty text"


BAD_CASES = ["missing input", "unknown extension", "no text field", "non-string text", "tokenizer does not load",
             "tokenizer without eos", "output directory missing", "zero documents"]


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_input_is_refused_and_leaves_no_files(name, tmp_path, tiny_checkpoint, capsys):
    inputs, tokenizer_dir, output, said = bad_case(name, tmp_path, tiny_checkpoint)
    (tmp_path / "out").mkdir()
    assert run_prepare(inputs, tokenizer=tokenizer_dir, output=output) == 2
    message = capsys.readouterr().err
    assert message.startswith("dsmt data: error: ") and said in message, message
    assert written(tmp_path / "out") == []


def test_bad_record_in_a_gzipped_jsonl_under_a_pool(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    import gzip

    monkeypatch.setattr(prepare, "CHUNK_TEXTS", 2)  # the bad record comes while earlier chunks are in flight
    rows = [{"text": f"doc {i}"} for i in range(9)] + [{"title": "no text"}]
    data = tmp_path / "rows.jsonl.gz"
    data.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    (tmp_path / "out").mkdir()
    assert run_prepare([data], tokenizer=tiny_checkpoint, output=tmp_path / "out" / "c", workers=2) == 2
    assert "record 10 (line 10) has no field 'text'" in capsys.readouterr().err
    assert written(tmp_path / "out") == []


def old_corpus(tmp_path, tokenizer_dir) -> tuple[dict, object]:
    """A complete corpus at tmp_path/out/corpus.*; (its files' bytes, its prefix)."""
    first = tmp_path / "first.jsonl"
    first.write_text('{"text": "the old corpus"}\n')
    (tmp_path / "out").mkdir()
    prefix = tmp_path / "out" / "corpus"
    assert run_prepare([first], tokenizer=tokenizer_dir, output=prefix) == 0
    return {name: (tmp_path / "out" / name).read_bytes() for name in written(tmp_path / "out")}, prefix


def test_failed_run_leaves_an_earlier_corpus_intact(tmp_path, tiny_checkpoint, monkeypatch):
    before, prefix = old_corpus(tmp_path, tiny_checkpoint)
    assert sorted(before) == ["corpus.bin", "corpus.dsmt.json", "corpus.idx"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "new"}\n' * 5 + '{"text": null}\n')
    assert run_prepare([bad], tokenizer=tiny_checkpoint, output=prefix) == 2
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "new"}\n')

    def disk_full(**kwargs):  # the last write before the renames fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare, "write_sidecar", disk_full)
    assert run_prepare([good], tokenizer=tiny_checkpoint, output=prefix) == 2
    assert {name: (tmp_path / "out" / name).read_bytes() for name in written(tmp_path / "out")} == before


def test_full_disk_is_one_named_error_and_leaves_nothing(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "some words here"}\n' * 40)
    (tmp_path / "out").mkdir()
    real_add = IndexedDatasetBuilder.add_document

    def fill_at_the_tenth(builder, *args, **kwargs):  # as the .bin's write does on a full filesystem
        if len(builder.sequence_lengths) == 9:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(builder, *args, **kwargs)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_document", fill_at_the_tenth)
    assert run_prepare([data], tokenizer=tiny_checkpoint, output=tmp_path / "out" / "c") == 2
    message = capsys.readouterr().err
    first, fix = message.removeprefix("dsmt data: error: ").splitlines()
    assert first.startswith(f"[disk_full] the disk filled while dsmt data prepare wrote {tmp_path / 'out' / 'c'}"
                            ".bin/.idx"), message
    assert "40 documents tokenised): the corpus needs about " in first and " MB free" in first, message
    assert fix.startswith(f"fix: free space on the filesystem of {tmp_path / 'out'}"), message
    assert written(tmp_path / "out") == []


def test_a_killed_runs_temporaries_are_removed_by_the_next_run(tmp_path, tiny_checkpoint, capsys):
    import os
    import subprocess

    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid no longer runs, as a kill -9'd run's
    out = tmp_path / "out"
    out.mkdir()
    left = [out / f"c.tmp-{ended.pid}.bin", out / f"c.tmp-{ended.pid}.idx"]
    live = out / f"c.tmp-{os.getppid()}.bin"  # a running process's (another run into the same output)
    for path in (*left, live, out / f"other.tmp-{ended.pid}.bin"):
        path.write_bytes(b"x" * 1000)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "ab"}\n')
    assert run_prepare([data], tokenizer=tiny_checkpoint, output=out / "c") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dsmt data prepare:")]
    assert said == [f"dsmt data prepare: removed c.tmp-{ended.pid}.bin, c.tmp-{ended.pid}.idx (0.0 MB), left by an "
                    f"interrupted run into {out / 'c'} (pid {ended.pid}, no longer running); kept {live.name}: pid "
                    f"{os.getppid()} is running (another dsmt data prepare into the same --output?)"], said
    assert written(out) == sorted(["c.bin", "c.idx", "c.dsmt.json", live.name, f"other.tmp-{ended.pid}.bin"])


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_run_leaves_an_earlier_corpus_intact(workers, tmp_path, tiny_checkpoint, monkeypatch, capsys):
    before, prefix = old_corpus(tmp_path, tiny_checkpoint)
    monkeypatch.setattr(prepare, "CHUNK_TEXTS", 2)
    data = tmp_path / "long.jsonl"
    data.write_text('{"text": "more words"}\n' * 20)
    checked = []

    def interrupt_at_the_third_chunk(**kwargs):  # Ctrl-C while the pool has chunks in flight
        checked.append(1)
        if len(checked) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "_check_id_range", interrupt_at_the_third_chunk)
    assert run_prepare([data], tokenizer=tiny_checkpoint, output=prefix, workers=workers) == 130
    assert "interrupted" in capsys.readouterr().err
    assert {name: (tmp_path / "out" / name).read_bytes() for name in written(tmp_path / "out")} == before


def test_a_worker_killed_midway_is_an_error_not_a_hang(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    import os

    monkeypatch.setattr(prepare, "CHUNK_TEXTS", 2)
    monkeypatch.setattr(prepare, "WORKER_CHECK_S", 0.05)
    real_tokenize_chunk = prepare.tokenize_chunk

    def die_on_the_poisoned_chunk(*, tokenizer, texts):  # as the OOM killer would: no exception, no result
        if "poison" in texts:
            os._exit(9)
        return real_tokenize_chunk(tokenizer=tokenizer, texts=texts)

    monkeypatch.setattr(prepare, "tokenize_chunk", die_on_the_poisoned_chunk)  # the forked workers inherit it
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in ["a", "b", "c", "poison", "d", "e"]))
    (tmp_path / "out").mkdir()
    assert run_prepare([data], tokenizer=tiny_checkpoint, output=tmp_path / "out" / "c", workers=2) == 2
    assert "a tokenizer worker process died (1 of 2 replaced)" in capsys.readouterr().err
    assert written(tmp_path / "out") == []
