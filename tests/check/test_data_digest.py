"""Data checked once (toolkit/data/check_digest.py): `dsmt generate` and `dsmt train`'s launcher write
data_check.json for the record files the checks formatted; a rank whose spec has the same data section verifies the
files against it instead of formatting every record again; a changed file is an error naming it; no digest (or one
for another data section) is the full check. In-process: the ranks are `rank_job` calls, the launcher's ranks a stub."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from toolkit.check.job import check_job, rank_job
from toolkit.data.check_digest import DIGEST_FILE, RECORDS_NOT_FORMATTED, DataChangedError
from toolkit.data.files import digest_file
from toolkit.generate.writer import write_run_dir
from toolkit.spec.load import load_spec

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"


def _spied(monkeypatch) -> list[str]:
    """The record checks (the loader + formatter of every record, toolkit/check/data_checks.py), replaced by a spy
    that finds nothing: the labels of the sources they were called for."""
    from toolkit.check import checks, data_checks

    calls = []
    monkeypatch.setattr(data_checks, "record_problems", lambda *, label, data: calls.append(label) or [])
    monkeypatch.setattr(checks, "validation_record_problems", lambda *, data: calls.append("validation") or [])
    return calls


@pytest.fixture
def formatted(monkeypatch):
    return _spied(monkeypatch)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """configs/tiny-cpu.yaml on records (data.mix of a jsonl file and a folder of two, data.validation_path),
    `dsmt generate`d into run/ once; data.bak/ and run.bak/ keep the files as they were."""
    root = tmp_path_factory.mktemp("digest")
    data = root / "data"
    (data / "folder").mkdir(parents=True)
    lines = STORIES.read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (data / "folder" / "a.jsonl").write_text("\n".join(lines[40:60]) + "\n")
    (data / "folder" / "b.jsonl").write_text("\n".join(lines[60:80]) + "\n")
    (data / "val.jsonl").write_text("\n".join(lines[80:90]) + "\n")
    raw = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    raw["training"]["output_dir"] = str(root / "out")
    raw["data"] = {"mix": [{"path": str(data / "train.jsonl"), "weight": 0.5},
                           {"path": str(data / "folder"), "weight": 0.5}],
                   "validation_path": str(data / "val.jsonl")}
    (root / "job.yaml").write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert _spied(monkeypatch) == []
        write_run_dir(job=check_job(load_spec(root / "job.yaml")), out_dir=root / "run")
    for name in ("data", "run"):
        shutil.copytree(root / name, root / f"{name}.bak")  # copy2: sizes, contents and mtimes as digested
    return root


@pytest.fixture
def root(generated):
    """The generated job; whatever a test changed in data/ and run/ is put back after it."""
    yield generated
    for name in ("data", "run"):
        shutil.rmtree(generated / name)
        shutil.copytree(generated / f"{name}.bak", generated / name)


def test_generate_writes_the_digest_of_every_checked_record_file(root):
    digest = json.loads((root / "run" / DIGEST_FILE).read_text())
    data = root / "data"
    listed = [(entry["source"], entry["path"]) for entry in digest["files"]]
    assert listed == [("data.mix[0]", str(data / "train.jsonl")), ("data.mix[1]", str(data / "folder" / "a.jsonl")),
                      ("data.mix[1]", str(data / "folder" / "b.jsonl")),
                      ("data.validation_path", str(data / "val.jsonl"))]
    for entry in digest["files"]:
        stat = Path(entry["path"]).stat()
        assert (entry["size"], entry["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
        assert entry["xxh3_128"] == digest_file(Path(entry["path"]))
    assert digest["dsmt_version"] and digest["record_checks"] and len(digest["data_section_xxh3_128"]) == 32


def test_no_digest_without_records(tmp_path):
    """Synthetic tokens: nothing to verify, so no file (the run directory's list stays what it was)."""
    raw = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    raw["training"]["output_dir"] = str(tmp_path / "out")
    written = write_run_dir(job=check_job(load_spec_raw(raw, tmp_path)), out_dir=tmp_path / "run")
    assert not (tmp_path / "run" / DIGEST_FILE).exists() and all(p.name != DIGEST_FILE for p in written)


def load_spec_raw(raw: dict, folder: Path):
    (folder / "raw.yaml").write_text(yaml.safe_dump(raw))
    return load_spec(folder / "raw.yaml")


def test_a_rank_with_a_matching_digest_formats_no_record(root, formatted, capsys):
    job = rank_job(config=None, overrides=(), run_dir=root / "run")
    assert formatted == []  # not a record formatted: the files were hashed instead
    assert RECORDS_NOT_FORMATTED in job.report.rules("info") and job.run_dir == root / "run"
    assert "4 record file(s), " in capsys.readouterr().out


def test_without_a_digest_or_for_another_data_section_a_rank_checks_every_record(root, formatted):
    resolved = root / "run" / "job.resolved.yaml"
    resolved.write_text(resolved.read_text().replace("shuffle: true", "shuffle: false"))  # another data section
    job = rank_job(config=None, overrides=(), run_dir=root / "run")
    assert formatted == ["data.mix[0]", "data.mix[1]", "validation"] and not job.spec.data.shuffle
    formatted.clear()
    (root / "run" / DIGEST_FILE).unlink()  # a run directory written before the digest existed
    job = rank_job(config=None, overrides=(), run_dir=root / "run")
    assert formatted == ["data.mix[0]", "data.mix[1]", "validation"]
    assert RECORDS_NOT_FORMATTED not in job.report.rules("info")


def _same_size_other_content(path: Path) -> None:
    path.write_text(path.read_text().replace("a", "e", 1))  # an edit: a new mtime, so the rank hashes the file


CHANGES = {
    "size": ("train.jsonl", lambda p: p.write_text(p.read_text() + '{"text": "one more"}\n'), "6196 bytes, 6175 when"),
    "content": ("train.jsonl", _same_size_other_content, "same size, other content"),
    "missing": ("val.jsonl", lambda p: p.unlink(), "missing (it was checked)"),
    "added": ("folder/c.jsonl", lambda p: shutil.copy(p.parent / "a.jsonl", p), "added since the check"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_file_is_an_error_naming_it(root, formatted, change):
    name, edit, said = CHANGES[change]
    edit(root / "data" / name)
    with pytest.raises(DataChangedError) as raised:
        rank_job(config=None, overrides=(), run_dir=root / "run")
    text = str(raised.value)
    line = next(line for line in text.splitlines() if f"{root / 'data' / name}: " in line)  # the file named
    assert said in line and text.startswith("[data_changed_since_check]"), text
    assert "dsmt generate" in text and str(root / "run" / DIGEST_FILE) in text  # the fixes
    assert formatted == []


def test_a_file_of_the_same_size_and_mtime_is_not_hashed(root, formatted, monkeypatch):
    """Same size and mtime is the file the head checked: no rank reads the corpus before rendezvous."""
    from toolkit.data import check_digest

    hashed = []
    monkeypatch.setattr(check_digest, "digest_file", lambda path: hashed.append(path))
    job = rank_job(config=None, overrides=(), run_dir=root / "run")
    assert hashed == [] and formatted == [] and RECORDS_NOT_FORMATTED in job.report.rules("info")


def test_a_copy_with_a_new_mtime_and_the_same_records_is_no_change(root, formatted):
    os.utime(root / "data" / "train.jsonl", ns=(1, 1))  # as cp without -p leaves a node's copy
    job = rank_job(config=None, overrides=(), run_dir=root / "run")
    assert formatted == [] and RECORDS_NOT_FORMATTED in job.report.rules("info")


def test_the_train_launcher_writes_the_digest_its_ranks_verify(root, formatted, monkeypatch):
    """`dsmt train job.yaml` (no run directory): the digest goes into the output directory under the run lock,
    where a rank started with --config only finds it."""
    from toolkit import backend
    from toolkit.launch import local
    from toolkit.train.job.launch import launch_training

    started = []
    monkeypatch.setattr(local, "launch_local_workers", lambda **kwargs: started.append(kwargs))
    monkeypatch.setattr(backend, "select", lambda **kwargs: None)  # the CPU backend: megatron-core's imports
    launch_training(job=check_job(load_spec(root / "job.yaml")), spec_file=root / "job.yaml")
    assert started and (root / "out" / DIGEST_FILE).is_file()
    formatted.clear()
    job = rank_job(config=str(root / "job.yaml"), overrides=(), run_dir=None)
    assert formatted == [] and RECORDS_NOT_FORMATTED in job.report.rules("info")
