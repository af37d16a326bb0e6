"""Every ready spec in configs/ passes `dsmt check`."""

from pathlib import Path

import pytest

from toolkit.check.checks import check_file

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_the_promised_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"tiny-cpu", "llama3-8b-finetune-1x8-h100", "llama3-70b-8x8-h100", "qwen2-7b-2x8-a100"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_passes_check(path):
    _, report = check_file(path)
    assert report.ok, report.to_text()
