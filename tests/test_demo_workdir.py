"""`dsmt demo`'s directory: a re-run replaces the previous demo whole, a failed or interrupted one leaves it as it
was, and a directory the demo did not write is never touched (toolkit/demo/files.py)."""

import pytest

from toolkit.demo.files import MARKER, replace_workdir
from toolkit.errors import DsmtError


def _build(workdir, *, name, result=True):
    def build():
        (workdir / name).write_text(name)
        if isinstance(result, BaseException):
            raise result
        return result
    return build


def test_a_rerun_replaces_the_previous_demo_whole(tmp_path):
    workdir = tmp_path / "dsmt-demo"
    assert replace_workdir(workdir=workdir, build=_build(workdir, name="first"))
    assert replace_workdir(workdir=workdir, build=_build(workdir, name="second"))
    assert sorted(p.name for p in workdir.iterdir()) == sorted([MARKER, "second"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dsmt-demo"]  # nothing left beside it


@pytest.mark.parametrize("outcome", [False, KeyboardInterrupt()])
def test_a_failed_or_interrupted_rerun_leaves_the_previous_demo(tmp_path, outcome, capsys):
    workdir = tmp_path / "dsmt-demo"
    replace_workdir(workdir=workdir, build=_build(workdir, name="first"))
    if isinstance(outcome, BaseException):
        with pytest.raises(KeyboardInterrupt):
            replace_workdir(workdir=workdir, build=_build(workdir, name="second", result=outcome))
    else:
        assert not replace_workdir(workdir=workdir, build=_build(workdir, name="second", result=outcome))
    assert sorted(p.name for p in workdir.iterdir()) == sorted([MARKER, "first"])
    assert (tmp_path / ".dsmt-demo.failed" / "second").is_file()  # the failed run's files, for a look
    assert "the failed run's files are in" in capsys.readouterr().out


def test_a_directory_the_demo_did_not_write_is_refused_untouched(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(DsmtError, match=r"not empty and was not written by `dsmt demo`"):
        replace_workdir(workdir=home, build=_build(home, name="x"))
    assert sorted(p.name for p in home.iterdir()) == ["thesis.tex"]
    (tmp_path / "file").write_text("")
    with pytest.raises(DsmtError, match="is not a directory"):
        replace_workdir(workdir=tmp_path / "file", build=_build(tmp_path, name="x"))
