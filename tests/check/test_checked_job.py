"""The CheckedJob the checks hand every runner (toolkit/check/job.py, toolkit/spec/checked.py): derived once,
immutable, never holding an error, and the spec file read once on its way there."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from toolkit.check.job import check_job_file
from toolkit.errors import Problem, Report, SpecError
from toolkit.generate.deepspeed_config import build_deepspeed_config
from toolkit.spec.checked import CheckedJob
from toolkit.spec.layout import derive_layout
from toolkit.spec.load import load_spec

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


@pytest.fixture
def tiny(tmp_path):
    """configs/tiny-cpu.yaml, its output_dir in tmp_path."""
    raw = yaml.safe_load(TINY.read_text())
    raw["training"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_job_holds_what_the_runners_derive_and_cannot_be_changed(tiny):
    job = check_job_file(tiny)
    spec = load_spec(tiny)
    assert job.spec == spec and job.report.ok and job.run_dir is None
    assert job.layout == derive_layout(spec) and (job.layout.dp, job.layout.grad_accum_steps) == (2, 2)
    assert (job.model.hidden_size, job.model.num_kv_heads, job.model.vocab_size) == (64, 2, 1000)
    assert job.ds_config() == build_deepspeed_config(spec=spec, layout=derive_layout(spec))
    with pytest.raises(TypeError):
        job.deepspeed_config["train_batch_size"] = 1  # read-only: every runner sees the checked config
    with pytest.raises(TypeError):
        job.deepspeed_config["zero_optimization"]["stage"] = 3  # all the way down
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.spec = spec
    copy = job.ds_config()
    copy["zero_optimization"]["stage"] = 3  # what deepspeed.initialize is handed may be edited by it
    assert job.deepspeed_config["zero_optimization"]["stage"] == 1


def test_a_spec_with_an_error_gets_no_job(tiny):
    with pytest.raises(SpecError) as raised:
        check_job_file(tiny, overrides=["parallel.tp=3"])
    assert "heads_vs_tp" in raised.value.report.rules()
    fine = check_job_file(tiny)
    broken = Report(source="x", problems=(Problem("error", "heads_vs_tp", "tp=3"),))
    with pytest.raises(ValueError, match="without errors"):
        dataclasses.replace(fine, report=broken)
    with pytest.raises(ValueError, match="without errors"):
        CheckedJob(spec=fine.spec, layout=fine.layout, model=fine.model, deepspeed_config={}, report=broken)


def test_ignored_rules_are_the_callers_to_answer(tiny):
    """`toolkit.api.initialize`: a script brings its batches, so a spec without data is no error there."""
    raw = yaml.safe_load(tiny.read_text())
    raw.pop("data", None)
    tiny.write_text(yaml.safe_dump(raw))
    with pytest.raises(SpecError, match="data_source"):
        check_job_file(tiny)
    job = check_job_file(tiny, ignore_rules=frozenset({"data_source"}))
    assert "data_source" not in {p.rule for p in job.report.problems}


def test_the_spec_file_is_read_once_on_the_way_to_a_launch(tiny, monkeypatch, capsys):
    """`dsmt train`'s launcher: the run-lock and run-identity refusals, `dsmt check`'s checks and the pre-launch
    pass all look at one reading of the file (they read it three times before)."""
    from toolkit.check.prelaunch import checked_file_before_launch
    from toolkit.spec import load

    reads = []
    real = load.read_spec_file
    monkeypatch.setattr(load, "read_spec_file", lambda path: reads.append(path) or real(path))
    job = checked_file_before_launch(path=str(tiny), overrides=(), run_dir=None)
    assert reads == [str(tiny)] and job.report.rules("info") >= {"deepspeed_config", "model"}
    assert "pre-launch checks passed" in capsys.readouterr().out
