"""Golden files for every artifact of every variant. Regenerate deliberately: DSMT_UPDATE_GOLDEN=1 pytest ..."""

import os

import pytest

from gen_helpers import GOLDEN_DIR, VARIANTS, render

UPDATE = os.environ.get("DSMT_UPDATE_GOLDEN") == "1"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_artifacts_match_golden(name):
    files = render(name)
    golden = GOLDEN_DIR / name
    if UPDATE:
        golden.mkdir(parents=True, exist_ok=True)
        for stale in golden.iterdir():
            stale.unlink()
        for file_name, text in files.items():
            (golden / file_name).write_text(text)
    expected = {p.name: p.read_text() for p in golden.iterdir()} if golden.is_dir() else {}
    assert sorted(files) == sorted(expected), "golden set differs; regenerate with DSMT_UPDATE_GOLDEN=1"
    for file_name, text in files.items():
        assert text == expected[file_name], f"{name}/{file_name} differs from golden; DSMT_UPDATE_GOLDEN=1 to accept"


def test_rendering_is_deterministic():
    assert render("tiny-cpu") == render("tiny-cpu")
