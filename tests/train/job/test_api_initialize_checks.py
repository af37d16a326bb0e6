"""`toolkit.api.initialize` before any process group, in-process (its run replaced by a stub): no rank formats the
records of a data section (the script brings its batches), and CUDA_DEVICE_MAX_CONNECTIONS is what the generated
launch scripts export, set while CUDA is not initialised, else a named warning."""

import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from toolkit import api
from toolkit.data.check_digest import RECORDS_NOT_FORMATTED

REPO = Path(__file__).resolve().parents[3]
ENV = api.CONNECTIONS_ENV


def tiny(tmp_path, **cluster) -> dict:
    raw = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    raw["training"]["output_dir"] = str(tmp_path / "out")
    raw["data"] = {"path": str(REPO / "examples" / "data" / "tiny_stories.jsonl")}
    raw["cluster"].update(cluster)
    return raw


def _tp2_cuda(tmp_path):
    raw = tiny(tmp_path, device="cuda", gpu="h100-80gb")
    raw["parallel"]["tp"], raw["training"]["precision"] = 2, "bf16"
    return api.job_spec(raw)


@pytest.fixture
def initialize(monkeypatch):
    """api.initialize with its run stubbed (start_run returns the checked job) and the record checks spied."""
    from toolkit.check import checks, data_checks
    from toolkit.launch import rank_output

    formatted = []
    monkeypatch.setattr(data_checks, "record_problems", lambda *, label, data: formatted.append(label) or [])
    monkeypatch.setattr(checks, "validation_record_problems", lambda *, data: formatted.append("validation") or [])
    monkeypatch.setattr(rank_output, "quiet_library_warnings", lambda **kwargs: None)  # process-wide filters
    monkeypatch.setitem(sys.modules, "toolkit.train.job.session", types.SimpleNamespace(start_run=lambda *, job: job))
    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    return formatted


@pytest.mark.parametrize("rank", ["0", "1"])
def test_no_rank_formats_the_records_the_script_does_not_read(initialize, tmp_path, monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    job = api.initialize(tiny(tmp_path))
    assert initialize == []
    assert RECORDS_NOT_FORMATTED in job.report.rules("info")


def test_a_cuda_job_sets_the_connections_before_cuda_starts(initialize, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "")
    monkeypatch.delenv(ENV)  # unset, and put back unset after the test
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    api.initialize(_tp2_cuda(tmp_path))
    assert os.environ[ENV] == "1"


@pytest.mark.parametrize("have, cuda_started, said", [
    (None, True, "is unset and CUDA was initialised before toolkit.api.initialize"),
    ("8", False, f"{ENV}=8 in the environment"),
])
def test_too_late_or_another_value_is_a_named_warning(tmp_path, monkeypatch, have, cuda_started, said):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_started)
    environ = {} if have is None else {ENV: have}
    with pytest.warns(api.LaunchEnvironmentWarning) as warned:
        api.ordered_kernel_launches(spec=_tp2_cuda(tmp_path), environ=environ)
    text = str(warned[0].message)
    assert text.startswith("[cuda_device_max_connections]") and said in text
    assert f"fix: export {ENV}=1 before the script starts" in text
    assert environ == ({} if have is None else {ENV: have})  # never changed under a running CUDA


@pytest.mark.parametrize("case", ["already_1", "cpu", "tp1"])
def test_nothing_to_do(tmp_path, monkeypatch, case):
    """Set as wanted, or a job the scripts export nothing for (the CPU; tp 1, where megatron has no TP overlap)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    spec = _tp2_cuda(tmp_path)
    if case == "cpu":
        spec = api.job_spec(tiny(tmp_path))
    elif case == "tp1":
        spec = api.job_spec({**spec.model_dump(mode="json"), "parallel": {"tp": 1}})
    environ = {ENV: "1"} if case == "already_1" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.ordered_kernel_launches(spec=spec, environ=environ)
    assert environ == ({ENV: "1"} if case == "already_1" else {})
