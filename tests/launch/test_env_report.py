"""`dsmt env`: the real command on this (CPU) machine, and the report of a mocked 8-GPU node."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.cuda.nccl

from toolkit.launch import env_report
from toolkit.launch.env_report import choose_backend, collect_environment, format_text

REPO = Path(__file__).resolve().parents[2]
REPORTED_DISTRIBUTIONS = ("torch", "deepspeed", "megatron-core", "transformers")
# What toolkit.backend.current() decides, run apart: on a CPU machine it patches the process it runs in.
CURRENT_BACKEND = (
    "import json; from toolkit.backend import current; b = current(); "
    "print(json.dumps({'name': b.name, 'dist_backend': b.dist_backend, 'te': b.use_transformer_engine}))"
)


def run_dsmt_env(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit.cli", "env", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def json_report() -> dict:
    return json.loads(run_dsmt_env("--json").stdout)


@pytest.fixture(scope="module")
def current_backend() -> dict:
    answer = subprocess.run([sys.executable, "-c", CURRENT_BACKEND], cwd=REPO, capture_output=True, text=True,
                            timeout=120, check=True)
    return json.loads(answer.stdout.splitlines()[-1])


@pytest.fixture
def gpu_node(monkeypatch):
    """torch as on an 8 x H100 node with a CUDA 12.4 build and NCCL 2.21.5; Transformer Engine present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(env_report, "transformer_engine_importable", lambda: True)


def test_json_versions_come_from_package_metadata(json_report):
    for name in REPORTED_DISTRIBUTIONS:
        assert json_report["packages"][name] == importlib.metadata.version(name)
    assert json_report["dsmt"] == importlib.metadata.version("dsmt")
    assert json_report["python"] == sys.version.split()[0]
    assert set(json_report) == {"dsmt", "python", "python_executable", "packages", "cuda", "backend", "environment"}


def test_json_backend_on_this_machine_is_what_current_chooses(json_report, current_backend):
    assert json_report["cuda"]["available"] is False
    assert json_report["backend"]["name"] == "cpu"
    assert json_report["backend"]["dist_backend"] == "gloo"
    assert json_report["backend"]["name"] == current_backend["name"]
    assert json_report["backend"]["dist_backend"] == current_backend["dist_backend"]
    assert (json_report["backend"]["layers"] == "transformer_engine") == current_backend["te"]


def test_text_names_every_package_and_the_backend_without_dict_dumps():
    answer = run_dsmt_env()
    text = answer.stdout
    for name in ("dsmt", "python", *env_report.PACKAGE_DISTRIBUTIONS):
        assert f"  {name} " in text
    assert "{" not in text
    backend_line = next(line for line in text.splitlines() if line.strip().startswith("name "))
    assert backend_line.split() == ["name", "cpu"]
    assert "dist backend" in text and "gloo" in text
    assert "Warning" not in text and "Warning" not in answer.stderr


def test_gpu_node_with_transformer_engine(gpu_node):
    report = collect_environment(environ={})
    assert report.cuda.devices == ["NVIDIA H100 80GB HBM3"] * 8
    assert report.cuda.nccl == "2.21.5" and report.cuda.build == "12.4"
    backend = report.backend
    assert (backend.name, backend.dist_backend, backend.layers) == ("cuda", "nccl", "transformer_engine")
    assert "8 CUDA devices" in backend.reason and "NCCL 2.21.5" in backend.reason
    text = format_text(report=report)
    assert "8 x NVIDIA H100 80GB HBM3" in text and "{" not in text
    assert json.loads(json.dumps(report.to_dict()))["backend"]["layers"] == "transformer_engine"


def test_gpu_node_without_transformer_engine_uses_local_layers(gpu_node, monkeypatch):
    monkeypatch.setattr(env_report, "transformer_engine_importable", lambda: False)
    backend = collect_environment(environ={}).backend
    assert (backend.name, backend.dist_backend, backend.layers) == ("cuda", "nccl", "local")
    assert "Transformer Engine is not installed" in backend.reason


def test_empty_cuda_visible_devices_hides_the_gpus(gpu_node, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = collect_environment(environ={"CUDA_VISIBLE_DEVICES": ""})
    assert (report.backend.name, report.backend.dist_backend, report.backend.layers) == ("cpu", "gloo", "local")
    assert "hides the GPUs" in report.backend.reason
    assert report.environment == {"CUDA_VISIBLE_DEVICES": ""}
    assert report.cuda.device_count == 0 and report.cuda.build == "12.4"


def test_choose_backend_agrees_with_current_on_this_machine(current_backend):
    chosen = choose_backend(cuda_available=torch.cuda.is_available(),
                            has_transformer_engine=env_report.transformer_engine_importable(),
                            cuda_build=torch.version.cuda, torch_version=torch.__version__)
    assert (chosen.name, chosen.dist_backend, chosen.layers == "transformer_engine") == (
        current_backend["name"], current_backend["dist_backend"], current_backend["te"])


def test_cuda_build_without_gpus_points_at_the_driver():
    backend = choose_backend(cuda_available=False, has_transformer_engine=True, cuda_build="12.4",
                             torch_version="2.6.0+cu124")
    assert (backend.name, backend.layers) == ("cpu", "local")
    assert "built for CUDA 12.4" in backend.reason and "nvidia-smi" in backend.reason
