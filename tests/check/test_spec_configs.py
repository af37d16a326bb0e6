"""Every ready spec in configs/ passes `dsmt check`; a template in configs/templates/ (it names the user's own
checkpoint and records, which are not here) fails only for those placeholder paths."""

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


TEMPLATES = sorted((Path(__file__).parents[2] / "configs" / "templates").glob("*.yaml"))


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_fails_only_for_its_placeholder_paths(path):
    _, report = check_file(path)
    assert report.rules("error") == {"model_shape"} and "/models/" in report.to_text(), report.to_text()
