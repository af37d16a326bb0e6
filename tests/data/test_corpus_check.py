"""A Megatron corpus damaged after `dsmt data prepare` (toolkit/data/corpus_check.py): each damage named by `dsmt check`
and by a rank's read with the same line, a corpus without sidecar range-checked on its .idx, the digests compared on
`dsmt check --deep`. One tiny corpus prepared per module; each test damages its own copy."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from toolkit.cli import main as dsmt
from toolkit.data import corpus_check
from toolkit.data.corpus_check import CorpusDamaged
from toolkit.check.data_checks import corpus_digest_problems, corpus_problems, damaged_problem
from toolkit.spec.schema import DataSpec

NUM_DOCUMENTS = 40
LENGTHS_AT = corpus_check.HEADER_BYTES  # int32 per sequence
POINTERS_AT = LENGTHS_AT + 4 * NUM_DOCUMENTS  # int64 per sequence


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 12))) for _ in range(NUM_DOCUMENTS)]
    (root / "in.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    assert dsmt(["data", "prepare", str(root / "in.jsonl"), "--tokenizer", str(tiny_checkpoint), "--output",
                 str(root / "c"), "--workers", "1", "--quiet"]) == 0
    return root / "c"


@pytest.fixture
def corpus(prepared, tmp_path):
    for suffix in (".bin", ".idx", ".dsmt.json"):
        shutil.copy(f"{prepared}{suffix}", tmp_path / f"c{suffix}")
    return tmp_path / "c"


def edit(path, offset: int, values: np.ndarray) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + values.nbytes] = values.tobytes()
    path.write_bytes(bytes(data))


def ten_lengths(prefix) -> None:
    """Ten lengths changed in pairs (+1, -1): the token total and every size stay the same."""
    idx = prefix.with_suffix(".idx")
    lengths = np.frombuffer(idx.read_bytes(), dtype=np.int32, count=NUM_DOCUMENTS, offset=LENGTHS_AT).copy()
    lengths[10:20] += np.array([1, -1] * 5, dtype=np.int32)
    edit(idx, LENGTHS_AT, lengths)


DAMAGE = {  # what is done to the corpus, what the message says
    "ten lengths": (ten_lengths, "c.idx: sequence 11 starts at byte"),
    "dtype byte": (lambda p: edit(p.with_suffix(".idx"), 17, np.array([4], dtype=np.uint8)),
                   "c.idx says its tokens are int32 (dtype code 4, 4 bytes each), but"),
    "unknown dtype": (lambda p: edit(p.with_suffix(".idx"), 17, np.array([9], dtype=np.uint8)),
                      "c.idx: dtype code 9 (byte 17) is none of megatron-core's"),
    "a pointer": (lambda p: edit(p.with_suffix(".idx"), POINTERS_AT + 8 * 17, np.array([10**6], dtype=np.int64)),
                  "c.idx: sequence 17 has length"),
    "magic": (lambda p: edit(p.with_suffix(".idx"), 0, np.frombuffer(b"NOTANIDX\x00", dtype=np.uint8)),
              "c.idx starts with b'NOTANIDX\\x00', not megatron's index magic"),
    "truncated .bin": (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-6]),
                       "c.bin holds "),
}


@pytest.mark.parametrize("scan_sequences", [corpus_check.SCAN_SEQUENCES, 7])  # 7: damage across slices
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_named_by_check_and_by_every_rank_alike(case, scan_sequences, corpus, monkeypatch):
    from toolkit.data.indexed import read_corpus

    monkeypatch.setattr(corpus_check, "SCAN_SEQUENCES", scan_sequences)
    damage, said = DAMAGE[case]
    damage(corpus)
    found = corpus_problems(label="data", data=DataSpec(format="megatron", path=str(corpus)), vocab_size=250)
    assert [(p.severity, p.rule) for p in found] == [("error", "corpus_damaged")], found
    assert found[0].message.startswith(f"data: {corpus}") and said in found[0].message, found[0].message
    assert found[0].fix.startswith(f"run dsmt data prepare again for {corpus}")
    with pytest.raises(CorpusDamaged) as raised:  # what a rank (and the dry run) reads before megatron-core does
        read_corpus(str(corpus), eod_fallback=2)
    assert str(raised.value).startswith(f"[corpus_damaged] {corpus}") and "\nfix: run dsmt data prepare" in str(
        raised.value)
    assert damaged_problem(label="data", err=raised.value) == found[0]  # one line in `dsmt check --deep`:
    assert corpus_digest_problems(data=DataSpec(format="megatron", path=str(corpus))) == []  # not hashed as well


def test_sequence_lengths_changed_in_a_way_that_keeps_the_sidecar_counts(corpus):
    ten_lengths(corpus)
    with pytest.raises(CorpusDamaged, match=r"sequence 11 starts at byte \d+, but sequence 10 \(length \d+ at byte "
                                            r"\d+\) ends at byte \d+: the index's lengths and pointers disagree"):
        corpus_check.check_corpus(corpus, sidecar=json.loads(corpus.with_suffix(".dsmt.json").read_text()))


def test_a_corpus_without_sidecar_is_range_checked_on_its_idx(corpus):
    corpus.with_suffix(".dsmt.json").unlink()  # as Megatron's preprocess_data.py leaves a corpus
    data = DataSpec(format="megatron", path=str(corpus))
    (found,) = corpus_problems(label="data", data=data, vocab_size=250)
    assert (found.severity, found.rule) == ("info", "megatron_corpus")
    assert f"{NUM_DOCUMENTS} documents" in found.message and "not prepared by dsmt" in found.message
    corpus.with_suffix(".bin").write_bytes(corpus.with_suffix(".bin").read_bytes()[:-6])
    (found,) = corpus_problems(label="data", data=data, vocab_size=250)
    assert found.rule == "corpus_damaged" and f"sequence {NUM_DOCUMENTS - 1} has length" in found.message
    assert "past the end of" in found.message


def test_deep_check_compares_the_digests(corpus):
    data = DataSpec(format="megatron", path=str(corpus))
    (found,) = corpus_digest_problems(data=data)
    assert (found.severity, found.rule) == ("info", "corpus_digests")
    assert "match their xxh3_128 digests" in found.message
    tokens = bytearray(corpus.with_suffix(".bin").read_bytes())
    tokens[10] ^= 1  # one token id: every size and the index stay as they were
    corpus.with_suffix(".bin").write_bytes(bytes(tokens))
    assert [p.severity for p in corpus_problems(label="data", data=data, vocab_size=250)] == ["info"]
    (found,) = corpus_digest_problems(data=data)
    assert (found.severity, found.rule) == ("error", "corpus_damaged")
    assert found.message.startswith(f"data: {corpus}.bin: its xxh3_128 digest is ") and "but dsmt data prepare " \
        "recorded" in found.message and "its bytes changed after it was prepared" in found.message


def test_the_format_constants_are_megatron_cores():
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    assert corpus_check.INDEX_MAGIC == _INDEX_HEADER
    assert corpus_check.DTYPE_CODES == {member.value: member.name for member in DType}


def test_a_sidecar_with_a_malformed_files_entry_is_refused(corpus):
    sidecar = json.loads(corpus.with_suffix(".dsmt.json").read_text())
    corpus.with_suffix(".dsmt.json").write_text(json.dumps({**sidecar, "files": {"bin": 12}}))
    (found,) = corpus_problems(label="data", data=DataSpec(format="megatron", path=str(corpus)), vocab_size=250)
    assert (found.severity, found.rule) == ("error", "megatron_sidecar")
    assert 'files is {"bin": 12}, not {"bin": {"size": BYTES, "xxh3_128": HEX}' in found.message


def test_the_end_of_training_raises_found_damage_and_waits_a_bounded_time(monkeypatch, capsys):
    """Rank 0 alone hashes while the others go on into the export's collectives: the wait before the export is
    bounded (a 1 TB corpus would outlast their collective timeout), and damage found by then fails the run."""
    import threading

    import toolkit.data.corpus_check as corpus_check

    release = threading.Event()
    monkeypatch.setattr(corpus_check, "check_digests", lambda prefix, *, sidecar: release.wait(10))
    corpus_check.DigestWatch(corpora=[("slow", None)])
    corpus_check.finish_digest_checks(wait_s=0.1)
    assert "had not finished 0 s after the last step" in capsys.readouterr().err
    release.set()

    def damaged(prefix, *, sidecar):
        raise corpus_check.CorpusDamaged("its digest differs", prefix=prefix)

    monkeypatch.setattr(corpus_check, "check_digests", damaged)
    corpus_check.DigestWatch(corpora=[("bad", None)])
    with pytest.raises(corpus_check.CorpusDamaged, match="its digest differs"):
        corpus_check.finish_digest_checks(wait_s=10)
