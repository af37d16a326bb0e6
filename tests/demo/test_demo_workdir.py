"""`dsmt demo`'s directory: a re-run replaces the previous demo's own files, keeps what the user made there (the
summary's train-tp2/), a failed or interrupted one leaves it as it was, and a directory the demo did not write is
never touched (toolkit/demo/files.py)."""

import pytest

from toolkit.demo.files import DEMO_ENTRIES, MARKER, DemoFiles, replace_workdir
from toolkit.errors import DsmtError

OWN = "summary.txt"  # one of the demo's own entries; the builds below write it with their own text


def _build(workdir, *, text, result=True):
    def build():
        (workdir / OWN).write_text(text)
        (workdir / "train").mkdir()
        (workdir / "train" / text).write_text(text)
        if isinstance(result, BaseException):
            raise result
        return result
    return build


def _user_run(workdir):
    """What the summary's "next:" hint has the user make inside the demo's directory."""
    (workdir / "train-tp2").mkdir()
    (workdir / "train-tp2" / "metrics.jsonl").write_text("the user's run")


def test_a_rerun_replaces_the_previous_demo(tmp_path):
    workdir = tmp_path / "dsmt-demo"
    assert replace_workdir(workdir=workdir, build=_build(workdir, text="first"))
    assert replace_workdir(workdir=workdir, build=_build(workdir, text="second"))
    assert sorted(p.name for p in workdir.iterdir()) == sorted([MARKER, OWN, "train"])
    assert (workdir / OWN).read_text() == "second" and [p.name for p in (workdir / "train").iterdir()] == ["second"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dsmt-demo"]  # nothing left beside it


def test_a_rerun_keeps_what_the_user_made_there(tmp_path, capsys):
    workdir = tmp_path / "dsmt-demo"
    assert replace_workdir(workdir=workdir, build=_build(workdir, text="first"))
    _user_run(workdir)
    assert replace_workdir(workdir=workdir, build=_build(workdir, text="second"))
    assert (workdir / "train-tp2" / "metrics.jsonl").read_text() == "the user's run"
    assert (workdir / OWN).read_text() == "second"
    assert f"keeping what is not the demo's own in {workdir}: train-tp2" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dsmt-demo"]


@pytest.mark.parametrize("outcome", [False, KeyboardInterrupt()])
def test_a_failed_or_interrupted_rerun_leaves_the_previous_demo(tmp_path, outcome, capsys):
    workdir = tmp_path / "dsmt-demo"
    replace_workdir(workdir=workdir, build=_build(workdir, text="first"))
    _user_run(workdir)
    if isinstance(outcome, BaseException):
        with pytest.raises(KeyboardInterrupt):
            replace_workdir(workdir=workdir, build=_build(workdir, text="second", result=outcome))
    else:
        assert not replace_workdir(workdir=workdir, build=_build(workdir, text="second", result=outcome))
    assert sorted(p.name for p in workdir.iterdir()) == sorted([MARKER, OWN, "train", "train-tp2"])
    assert (workdir / OWN).read_text() == "first" and (workdir / "train" / "first").is_file()
    assert (workdir / "train-tp2" / "metrics.jsonl").read_text() == "the user's run"
    failed = tmp_path / ".dsmt-demo.failed"
    assert (failed / OWN).read_text() == "second" and not (failed / "train-tp2").exists()  # for a look
    assert "the failed run's files are in" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dsmt-demo.failed", "dsmt-demo"]


def test_a_failed_first_run_leaves_no_directory(tmp_path):
    workdir = tmp_path / "dsmt-demo"
    assert not replace_workdir(workdir=workdir, build=_build(workdir, text="first", result=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dsmt-demo.failed"]


def test_every_path_the_demo_names_is_one_a_rerun_replaces(tmp_path):
    files = DemoFiles(workdir=tmp_path)
    for path in (files.hf, files.mcore, files.export, files.spec, files.run, files.train, files.trained):
        files.add(path, "x")  # refused unless under DEMO_ENTRIES
    with pytest.raises(ValueError, match="DEMO_ENTRIES"):
        files.add(tmp_path / "train-tp2", "a path a re-run would keep, not replace")
    assert MARKER in DEMO_ENTRIES and "train-tp2" not in DEMO_ENTRIES


def test_a_directory_the_demo_did_not_write_is_refused_untouched(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(DsmtError, match=r"not empty and was not written by `dsmt demo`"):
        replace_workdir(workdir=home, build=_build(home, text="x"))
    assert sorted(p.name for p in home.iterdir()) == ["thesis.tex"]
    (tmp_path / "file").write_text("")
    with pytest.raises(DsmtError, match="is not a directory"):
        replace_workdir(workdir=tmp_path / "file", build=_build(tmp_path, text="x"))
