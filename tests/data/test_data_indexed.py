"""Megatron corpora as training rows (toolkit/data/indexed.py), blends and mixes (toolkit/data/mix.py).

The corpora are written by `dsmt data prepare`; what the rows must hold is checked against the documents
tokenised here, independently: every EOD-free run inside a row (not cut by the row's edges) is one of the
corpus's documents, the positions restart after each EOD, and only the label read at an EOD is masked."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.distributed as dist

from toolkit.cli import main as dsmt
from toolkit.data.training import job_rows
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

SEQ = 16
EOS = 2  # the tiny tokenizer's </s>


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """megatron-core's BlendedDataset asks torch.distributed for the rank: a world of one."""
    from toolkit.launch.ports import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def write_corpus(tmp_path, name: str, letters: str, *, count: int = 80, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 12))) for _ in range(count)]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return texts


@pytest.fixture
def corpora(tmp_path, tiny_checkpoint):
    """Two prepared corpora with disjoint letters: A (a-m) and B (n-z)."""
    texts = {}
    for name, letters in (("a", "abcdefghijklm"), ("b", "nopqrstuvwxyz")):
        texts[name] = write_corpus(tmp_path, name, letters, seed=len(letters) + ord(name))
        code = dsmt(["data", "prepare", str(tmp_path / f"{name}.jsonl"), "--tokenizer", str(tiny_checkpoint),
                     "--output", str(tmp_path / f"corpus_{name}"), "--workers", "1"])
        assert code == 0
    return texts


def rows_of(data: DataSpec, *, tmp_path, tiny_checkpoint, part="train", num_samples=60):
    return job_rows(data=data, model_path=str(tiny_checkpoint), seq_length=SEQ, vocab_size=250, seed=3,
                    output_dir=tmp_path / "out", part=part, num_samples=num_samples)


def test_rows_are_documents_with_positions_and_eod_mask(corpora, tmp_path, tiny_checkpoint, tokenizer):
    documents = {tuple(tokenizer(text)["input_ids"] + [EOS]) for text in corpora["a"]}
    rows = rows_of(DataSpec(format="megatron", path=str(tmp_path / "corpus_a")), tmp_path=tmp_path,
                   tiny_checkpoint=tiny_checkpoint)
    assert len(rows) >= 60
    token_ids, loss_mask, positions = rows.rows(torch.arange(len(rows)))
    assert token_ids.shape == (len(rows), SEQ + 1) and loss_mask.shape == positions.shape == (len(rows), SEQ)
    whole_documents = 0
    for ids, mask, pos in zip(token_ids.tolist(), loss_mask.tolist(), positions.tolist()):
        inputs = ids[:-1]
        assert mask == [0.0 if token == EOS else 1.0 for token in inputs]  # only the label read at an EOD
        expected, start = [], 0
        for t, token in enumerate(inputs):
            expected.append(t - start)
            if token == EOS:
                start = t + 1
        assert pos == expected
        ends = [t for t, token in enumerate(ids) if token == EOS]
        for first, last in zip(ends, ends[1:]):  # runs between two EODs of the row: whole documents
            assert tuple(ids[first + 1:last + 1]) in documents
            whole_documents += 1
    assert whole_documents > 20


def test_blend_draws_the_requested_shares(corpora, tmp_path, tiny_checkpoint, tokenizer):
    b_ids = set(tokenizer("nopqrstuvwxyz")["input_ids"])
    a_ids = set(tokenizer("abcdefghijklm")["input_ids"])
    data = DataSpec(blend=[[0.3, str(tmp_path / "corpus_a")], [0.7, str(tmp_path / "corpus_b")]])
    rows = rows_of(data, tmp_path=tmp_path, tiny_checkpoint=tiny_checkpoint, num_samples=200)
    token_ids, _, _ = rows.rows(torch.arange(200))
    from_b = 0
    for ids in token_ids.tolist():
        letters = set(ids) - {EOS}
        assert letters <= a_ids or letters <= b_ids  # a sample comes from one corpus
        from_b += letters <= b_ids
    assert from_b == 140  # megatron-core's blending gives the exact shares over a prefix of the samples


def test_validation_split_is_held_out_documents(corpora, tmp_path, tiny_checkpoint):
    data = DataSpec(format="megatron", path=str(tmp_path / "corpus_a"), validation_fraction=0.25)
    train = rows_of(data, tmp_path=tmp_path, tiny_checkpoint=tiny_checkpoint)
    held_out = rows_of(data, tmp_path=tmp_path, tiny_checkpoint=tiny_checkpoint, part="validation")
    assert 0 < len(held_out) < len(train)
    train_runs = {tuple(r) for r in train.rows(torch.arange(len(train)))[0].tolist()}
    held_runs = {tuple(r) for r in held_out.rows(torch.arange(len(held_out)))[0].tolist()}
    assert not train_runs & held_runs
    assert held_out.counted_tokens() == int(held_out.rows(torch.arange(len(held_out)))[1].sum())


def test_mix_of_records_draws_by_weight(tmp_path, tiny_checkpoint):
    write_corpus(tmp_path, "a", "abc", count=30)
    write_corpus(tmp_path, "b", "xyz", count=30)
    data = DataSpec(mix=[{"path": str(tmp_path / "a.jsonl"), "weight": 1},
                         {"path": str(tmp_path / "b.jsonl"), "weight": 3}], packing=False)
    rows = rows_of(data, tmp_path=tmp_path, tiny_checkpoint=tiny_checkpoint)
    assert rows.shares() == [15, 45]  # 60 rows in all (30 + 30 records), a quarter from a.jsonl
    assert "15 from" in rows.describe()


def test_missing_corpus_and_foreign_ids_are_named(corpora, tmp_path, tiny_checkpoint):
    with pytest.raises(DsmtError, match=r"megatron_corpus_missing: .*nowhere.*lacks .*nowhere.bin.*dsmt data prepare"):
        rows_of(DataSpec(format="megatron", path=str(tmp_path / "nowhere")), tmp_path=tmp_path,
                tiny_checkpoint=tiny_checkpoint)
    with pytest.raises(DsmtError, match=r"token_ids_vocab: corpus .*corpus_b holds token id \d+ but the model's "
                                        r"vocab_size is 20"):
        job_rows(data=DataSpec(format="megatron", path=str(tmp_path / "corpus_b")), model_path=str(tiny_checkpoint),
                 seq_length=SEQ, vocab_size=20, seed=3, output_dir=tmp_path / "out", num_samples=10)


def test_check_names_a_damaged_sidecar(corpora, tmp_path):
    from toolkit.check.data_checks import corpus_problems

    (tmp_path / "corpus_a.dsmt.json").write_text("{not json")
    found = corpus_problems(label="data", data=DataSpec(format="megatron", path=str(tmp_path / "corpus_a")),
                            vocab_size=250)
    assert [(p.severity, p.rule) for p in found] == [("error", "megatron_sidecar")]
    assert "is not readable JSON" in found[0].message and "re-run dsmt data prepare" in found[0].message


def test_a_corpus_changed_after_prepare_fails_training_at_its_next_read(corpora, tmp_path, tiny_checkpoint):
    from toolkit.data.corpus_check import CorpusDamaged

    tokens = bytearray((tmp_path / "corpus_a.bin").read_bytes())
    tokens[10] ^= 1  # one token id: the sizes and the index stay right, only the digest differs
    (tmp_path / "corpus_a.bin").write_bytes(bytes(tokens))
    rows = rows_of(DataSpec(format="megatron", path=str(tmp_path / "corpus_a")), tmp_path=tmp_path,
                   tiny_checkpoint=tiny_checkpoint)
    rows.digest_watch.wait()  # rank 0's background check, which training does not wait for
    with pytest.raises(CorpusDamaged, match=r"^\[corpus_damaged\] .*corpus_a\.bin: its xxh3_128 digest is "):
        rows.rows(torch.arange(4))


def test_a_failed_index_build_is_named_on_every_rank(corpora, tmp_path, tiny_checkpoint, monkeypatch):
    """Rank 0 builds the index caches for every rank (toolkit/data/indexed.py): its OSError is a named error there,
    and its status file carries it to the other ranks, which wait on that file."""
    import numpy

    from toolkit.data.indexed import CorpusError
    from toolkit.launch.rank0 import RankTaskError, wait_for_task

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(numpy, "save", disk_full)  # megatron-core's GPTDataset writes its indices with it
    with pytest.raises(CorpusError, match=r"megatron_index_cache: megatron-core could not build the index caches "
                                          r"of .*corpus_a in .*No space left on device.*writable with free space"):
        rows_of(DataSpec(format="megatron", path=str(tmp_path / "corpus_a")), tmp_path=tmp_path,
                tiny_checkpoint=tiny_checkpoint)
    status_file, = (tmp_path / "out" / "data-cache" / "megatron").glob(".dsmt-index-build-*.status.json")
    status = json.loads(status_file.read_text())
    with pytest.raises(RankTaskError, match=r"^building .* failed on rank 0: CorpusError: megatron_index_cache: "):
        wait_for_task(status_file=status_file, token=status["token"], what="building the index caches")
