"""The job's processes when one of them goes wrong: the rank that failed first is the one named (killed, or
stopped: named as hung by the launcher), killing the launcher or torchrun ends every rank and helper, and a full
disk during a save ends in one named line."""

import signal
import subprocess
import time

import psutil
import pytest

from fault_helpers import (job_processes, kill_all, output_of, rank_at_step, rank_pids, start, still_running,
                           wait_until)
from train_helpers import write_spec

pytestmark = pytest.mark.multiproc
LONG = {"dp": 2, "steps": 400, "checkpoint_interval": 1000, "seq": 16, "global_batch": 4, "micro": 1}


def _long_run(tiny_llama, tmp_path, *, cold=False, **training):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "run", **LONG,
                      extra={"training": training} if training else None)
    launcher = start(spec, cold=cold)
    wait_until(lambda: rank_at_step(tmp_path / "run", rank=1, step=3), timeout_s=300, what="step 3",
               process=launcher)
    return spec, launcher


def test_killed_rank_is_named_not_the_survivor(tiny_llama, tmp_path):
    spec, launcher = _long_run(tiny_llama, tmp_path)
    psutil.Process(rank_pids(tmp_path / "run", nprocs=2)[1]).send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0
    output = output_of(launcher, spec)
    assert "rank 1 of 2 failed first (killed by SIGKILL)" in output, output[-3000:]
    assert "rank 0 of 2" not in output  # the survivor that saw its peer's connection drop is not blamed


def test_stopped_rank_is_named_as_hung_and_the_job_ended(tiny_llama, tmp_path):
    """A rank that stops reporting (SIGSTOP) is named by dsmt's launcher after training.hang_timeout_s, not after
    the collective timeout (180 s here) plus torchrun's shutdown wait, and every process of the job is killed."""
    spec, launcher = _long_run(tiny_llama, tmp_path, cold=True, hang_timeout_s=5)
    job = job_processes(launcher, tmp_path / "run", nprocs=2)
    stopped = psutil.Process(rank_pids(tmp_path / "run", nprocs=2)[1])
    stopped.send_signal(signal.SIGSTOP)
    try:  # within the 180 s collective timeout: the launcher's watch ended the job
        returncode, left = launcher.wait(timeout=120), still_running(job)
    finally:
        kill_all(still_running(job))
    assert returncode == 1 and not left, [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in left]
    output = output_of(launcher, spec)
    [first] = [line for line in output.splitlines() if "error:" in line]
    assert first.startswith(f"dsmt train: error: [rank_hung] rank 1 of 2 (pid {stopped.pid}) stopped reporting "), first
    assert "its process is stopped (SIGSTOP, Ctrl-Z or a debugger); the job was ended" in first, first
    assert "SIGKILL" not in output, output[-3000:]


@pytest.mark.parametrize("killed", ["dsmt train", "torchrun"])
def test_killing_the_launcher_ends_every_rank_and_helper(tiny_llama, tmp_path, killed):
    """Through torchrun (not the test session's warm ranks): the path a user's `dsmt train` takes."""
    spec, launcher = _long_run(tiny_llama, tmp_path, cold=True)
    job = job_processes(launcher, tmp_path / "run", nprocs=2)
    torchrun = next(p for p in psutil.Process(launcher.pid).children() if "torch.distributed.run" in " ".join(p.cmdline()))
    (launcher_process := psutil.Process(launcher.pid) if killed == "dsmt train" else torchrun).send_signal(signal.SIGKILL)
    gone_by = time.monotonic() + 60
    while still_running(job) and time.monotonic() < gone_by:
        time.sleep(0.2)
    left = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in still_running(job)]
    assert not left, left
    assert launcher_process.pid in {p.pid for p in job}
    assert not (tmp_path / "run" / "final-hf").exists()
    if killed == "torchrun":
        assert launcher.wait(timeout=30) != 0


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of request.param MB (a checkpoint of this run is ~1.8 MB; the run's other files ~1 MB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}m", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


# 6 MB: two checkpoints fit, the check before the third refuses it from the second's size; 2 MB: the first save
# (no earlier size to check) is refused from the size of the ranks' shares before a byte is written. A disk that
# fills during a save (the shares fit, something else takes the space) is test_fault_units.py's.
@pytest.mark.parametrize("small_disk, expected", [(6, "needs about 1.8 MB (the size of the previous checkpoint)"),
                                                  (2, "the state of checkpoint step_000002 needs about")],
                         indirect=["small_disk"], ids=["checked-before", "first-save-checked"])
def test_disk_full_is_one_named_error(tiny_llama, tmp_path, small_disk, expected):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=small_disk / "run", dp=2, steps=8,
                      checkpoint_interval=2, seq=16, global_batch=4, micro=1, extra={"training": {"keep_checkpoints": 3}})
    launcher = start(spec)
    assert launcher.wait(timeout=300) != 0
    output = output_of(launcher, spec)
    assert "[disk_full]" in output and expected in output and "MB free" in output, output[-3000:]
    assert "Traceback" not in output and "JSONDecodeError" not in output, output[-3000:]
    partials = list((small_disk / "run" / "checkpoints").glob(".partial-*"))
    assert len(partials) <= 1 and (not partials or "is removed at the next start" in output), output[-3000:]
