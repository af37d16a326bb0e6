"""A run killed with SIGKILL resumes from its last complete checkpoint and continues exactly as an
uninterrupted run; a half-written checkpoint is never taken. The killed run also keeps only its newest two
checkpoints (`training.keep_checkpoints`) and its tokenised data cache is reused by the resumed run."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from toolkit.train.checkpoint.checkpoints import COMPLETE_MARKER, complete_tags, latest_complete
from train_helpers import read_metrics, write_spec

pytestmark = pytest.mark.multiproc
STEPS = 40


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def launch(spec):
    return subprocess.Popen([sys.executable, "-m", "toolkit.cli", "train", "--config", str(spec)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sigkill_then_resume_matches_uninterrupted(tiny_llama, tmp_path):
    reference_spec = write_spec(tmp_path / "ref.yaml", model_dir=tiny_llama, output_dir=tmp_path / "ref", dp=2,
                                steps=STEPS, checkpoint_interval=5, seq=16, global_batch=4, micro=1)
    killed_spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "run", dp=2,
                             steps=STEPS, checkpoint_interval=5, seq=16, global_batch=4, micro=1,
                             extra={"training": {"keep_checkpoints": 2}})
    first = launch(killed_spec)
    marker = tmp_path / "run" / "checkpoints" / "step_000010" / COMPLETE_MARKER
    deadline = time.time() + 300
    while not marker.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, f"the run ended before it could be killed: {first.stderr.read()[-2000:]}"
    # SIGKILL the launcher and every rank, mid-run (torchrun puts its workers in sessions of their own).
    job = [first.pid] + [child.pid for child in psutil.Process(first.pid).children(recursive=True)]
    for pid in job:
        os.kill(pid, signal.SIGKILL)
    first.wait()
    psutil.wait_procs([p for p in map(_process, job) if p is not None], timeout=30)
    assert not (tmp_path / "run" / "final-hf").exists()
    done_before = max(r["step"] for r in read_metrics(tmp_path / "run"))
    assert 10 <= done_before < STEPS
    # A checkpoint directory without its completion marker (as a kill during a save leaves it) is ignored.
    (tmp_path / "run" / "checkpoints" / "step_000039").mkdir(exist_ok=True)
    assert latest_complete(tmp_path / "run" / "checkpoints").startswith("step_0000")
    assert int(latest_complete(tmp_path / "run" / "checkpoints")[5:]) >= 10
    cache_entries = list((tmp_path / "run" / "data-cache").iterdir())
    assert len(cache_entries) == 1 and (cache_entries[0] / "meta.json").is_file()
    cache_written_ns = (cache_entries[0] / "meta.json").stat().st_mtime_ns

    for spec in (killed_spec, reference_spec):
        result = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", "--config", str(spec)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    resumed, reference = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference], abs=1e-6)
    assert (tmp_path / "run" / "final-hf" / "model.safetensors").is_file()
    assert complete_tags(tmp_path / "run" / "checkpoints") == ["step_000035", "step_000040"]
    assert (tmp_path / "run" / "checkpoints" / "step_000039").is_dir()  # incomplete tags are never pruned
    assert list((tmp_path / "run" / "data-cache").iterdir()) == cache_entries  # reused, not rewritten
    assert (cache_entries[0] / "meta.json").stat().st_mtime_ns == cache_written_ns
