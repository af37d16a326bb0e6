"""Checkpoint tags are ordered by step everywhere, never by name: step_000010 after step_000009, and a tag written
without zero padding (step_10) after step_9, which a name sort would put first."""

import pytest

from toolkit.train.checkpoint import checkpoints, manifest
from toolkit.train.checkpoint.folders import COMPLETE_MARKER, remove_leftovers, tag_order, tag_step

BY_STEP = ["step_000008", "step_000009", "step_9", "step_000010", "step_10", "step_000100"]  # equal steps: by name


def _tag_dirs(checkpoint_dir, names, *, complete: bool):
    for name in names:
        (checkpoint_dir / name).mkdir()
        if complete:
            (checkpoint_dir / name / COMPLETE_MARKER).write_text("{}")


def test_the_step_of_a_tag_padded_or_not():
    assert [tag_step(name) for name in ("step_000010", "step_10", "step_0", "step_", "step_1a", "latest_complete")] \
        == [10, 10, 0, None, None, None]
    assert sorted(reversed(BY_STEP), key=tag_order) == BY_STEP
    assert sorted(["notes", "step_2", "step_10"], key=tag_order) == ["step_2", "step_10", "notes"]


@pytest.mark.parametrize("names", [["step_9", "step_10", "step_000008"], ["step_000009", "step_000010", "step_11"]])
def test_complete_tags_latest_and_pruning_go_by_step(tmp_path, names):
    _tag_dirs(tmp_path, names, complete=True)
    oldest, middle, newest = sorted(names, key=tag_step)
    assert checkpoints.complete_tags(tmp_path) == [oldest, middle, newest]
    assert checkpoints.latest_complete(tmp_path) == newest
    assert checkpoints.prune(tmp_path, keep=2) == [oldest]
    assert checkpoints.complete_tags(tmp_path) == [middle, newest]


def test_verify_and_leftover_removal_list_tags_by_step(tmp_path):
    _tag_dirs(tmp_path, ["step_10", "step_9", "step_000011"], complete=False)  # no marker: interrupted saves
    assert [verdict.tag for verdict in manifest.verify_run(tmp_path)] == ["step_9", "step_10", "step_000011"]
    assert [line.split()[1].rsplit("/", 1)[-1].rstrip(":") for line in remove_leftovers(tmp_path)] \
        == ["step_9", "step_10", "step_000011"]
