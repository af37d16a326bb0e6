"""Faults a preempted, crowded or misbehaving job meets, each as a user would meet it with `dsmt train`:
a kill in the middle of a save, a second run into the same output directory, a damaged checkpoint, a diverged
loss, a preemption's SIGTERM. Nothing is lost: the resumed losses equal an uninterrupted run's."""

import re
import shutil
import signal
import subprocess
import sys

import pytest

from fault_helpers import (REPO, job_processes, kill_all, output_of, rank_at_step, run, start, still_running,
                           wait_until)
from toolkit.train.checkpoint.checkpoints import complete_tags
from toolkit.train.checkpoint.manifest import verify_run
from train_helpers import read_metrics, write_spec

pytestmark = pytest.mark.multiproc
STEPS = 48  # long enough for a second `dsmt train` to start (and be refused) while the first still saves
INTERVAL = 8
SHAPE = {"dp": 2, "steps": STEPS, "checkpoint_interval": INTERVAL, "seq": 16, "global_batch": 4, "micro": 1}
LAST, BEFORE_LAST = f"step_{STEPS:06d}", f"step_{STEPS - INTERVAL:06d}"


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    """An uninterrupted run: its last two checkpoints kept (keep_checkpoints 2), its metrics the truth."""
    root = tmp_path_factory.mktemp("faults-ref")
    spec = write_spec(root / "ref.yaml", model_dir=tiny_llama, output_dir=root / "ref", **SHAPE)
    result = run(spec)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "ref"


def _losses(output_dir, steps):
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if r["step"] in steps}


def test_kill_mid_save_second_run_refused_then_exact_resume(tiny_llama, reference, tmp_path):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "run", **SHAPE)
    checkpoints = tmp_path / "run" / "checkpoints"
    first = start(spec)
    wait_until(lambda: (tmp_path / "run" / ".dsmt-run.lock").is_file(), timeout_s=120, what="the run's lock",
               process=first)
    second = run(spec, timeout_s=120)  # the same command again, while the first starts its ranks
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert "one_run_per_output_dir" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
    # Every process of the job killed while a save is half-way: its folder made, no marker yet.
    wait_until(lambda: any(checkpoints.glob(".partial-step_*")), timeout_s=300, what="a save",
               process=first, poll_s=0.002)
    kill_all(job_processes(first, tmp_path / "run", nprocs=2))
    first.wait(timeout=60)
    [partial] = checkpoints.glob(".partial-step_*")
    assert not (checkpoints / partial.name[len(".partial-"):]).exists()
    assert not (tmp_path / "run" / "final-hf").exists()
    [cache] = (tmp_path / "run" / "data-cache").iterdir()  # the tokenised records, reused by the resumed run
    cache_written_ns = (cache / "meta.json").stat().st_mtime_ns
    # The trap of the old save: a step folder with layout-free/ but no completion marker.
    (checkpoints / LAST / "layout-free").mkdir(parents=True)

    resumed = run(spec)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert f"took over the lock of a run that is gone (pid {first.pid}" in output, output[-3000:]
    assert "removed" in output and partial.name in output and LAST in output, output[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, STEPS + 1))
    assert _losses(tmp_path / "run", range(1, STEPS + 1)) == _losses(reference, range(1, STEPS + 1))
    assert complete_tags(checkpoints) == [BEFORE_LAST, LAST]  # keep_checkpoints: 2 (the default)
    assert (tmp_path / "run" / "final-hf" / "model.safetensors").is_file()
    assert list((tmp_path / "run" / "data-cache").iterdir()) == [cache]
    assert (cache / "meta.json").stat().st_mtime_ns == cache_written_ns
    assert not list(checkpoints.glob(".partial-*")) and not (tmp_path / "run" / ".dsmt-run.lock").exists()


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


def _verify(path):
    """`dsmt checkpoint verify PATH` as a user runs it: (exit code, output)."""
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "checkpoint", "verify", str(path)], cwd=REPO,
                            capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


def _problems(run_dir):
    return [p.line() for verdict in verify_run(run_dir) for p in verdict.problems]


def test_every_kind_of_checkpoint_file_is_checked(reference, tmp_path):
    copy = shutil.copytree(reference, tmp_path / "run")
    assert _problems(copy) == []
    tag = copy / "checkpoints" / LAST
    kinds = [tag / "state" / "rank_00001.safetensors", tag / "state" / "index.json", tag / "dsmt_layout.json",
             tag / "dsmt_rng_rank1.pt"]
    for path in kinds:
        name, saved = path.relative_to(tag).as_posix(), path.read_bytes()
        _flip_byte(path)
        assert [line for line in _problems(copy) if line.startswith(f"{name}: digest")], _problems(copy)
        path.write_bytes(saved[: len(saved) // 2])  # truncated
        assert [line for line in _problems(copy) if line.startswith(name) and "bytes" in line], _problems(copy)
        path.write_bytes(saved)
    assert _problems(copy) == []
    _flip_byte(kinds[0])
    code, output = _verify(copy)
    assert code == 1 and kinds[0].name in output and BEFORE_LAST in output, output


def test_damaged_newest_checkpoint_falls_back_exactly(tiny_llama, reference, tmp_path):
    copy = shutil.copytree(reference, tmp_path / "run")
    shutil.rmtree(copy / "final-hf")
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=copy, **SHAPE)
    damaged = copy / "checkpoints" / LAST / "state" / "rank_00000.safetensors"
    _flip_byte(damaged)
    refused = run(spec, "--no-fallback")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "checkpoint_damaged" in refused.stderr and LAST in refused.stderr
    assert "state/rank_00000.safetensors: digest" in refused.stderr, refused.stderr[-2000:]
    assert not (copy / "final-hf").exists()

    fell_back = run(spec)
    assert fell_back.returncode == 0, fell_back.stdout[-3000:] + fell_back.stderr[-3000:]
    assert f"falling back to {BEFORE_LAST}" in fell_back.stdout + fell_back.stderr
    again = range(STEPS - INTERVAL + 1, STEPS + 1)
    assert _losses(copy, again) == _losses(reference, again)  # the steps after BEFORE_LAST trained again, exactly
    assert _problems(copy) == []  # the last step saved anew over the damaged one

    done = run(spec)  # the same command once more: nothing left to train, and it says so
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"holds a checkpoint of step {STEPS}, the last (training.train_steps): nothing left to train" in (
        done.stdout + done.stderr), done.stdout[-3000:]
    assert _losses(copy, again) == _losses(reference, again)  # no step trained again


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_loss_stops_before_saving_the_bad_step(tiny_llama, tmp_path, precision):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "run", dp=2, steps=6,
                      checkpoint_interval=1, seq=16, global_batch=4, micro=1, lr=1e30,
                      extra={"training": {"precision": precision}})
    result = run(spec)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[non_finite_loss] step 2:" in result.stderr and "step_000001" in result.stderr, result.stderr[-3000:]
    assert complete_tags(tmp_path / "run" / "checkpoints") == ["step_000001"]
    assert not (tmp_path / "run" / "final-hf").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob(".partial-*"))


def test_sigterm_saves_the_step_then_the_run_resumes_exactly(tiny_llama, reference, tmp_path):
    """Preemption (SIGTERM to `dsmt train`, through torchrun as a user's run): every rank finishes its step, saves
    it, and the job exits 75 (toolkit/train/job/preemption.py); the same command again resumes from that step."""
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "run", **SHAPE)
    launcher = start(spec, cold=True)
    wait_until(lambda: rank_at_step(tmp_path / "run", rank=1, step=2), timeout_s=300, what="step 2",
               process=launcher)
    job = job_processes(launcher, tmp_path / "run", nprocs=2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 75, output_of(launcher, spec)[-3000:]
    output = output_of(launcher, spec)
    [said] = [line for line in output.splitlines() if "SIGTERM received" in line]  # rank 0's line, once
    stopped_after = int(re.fullmatch(r"dsmt train: SIGTERM received \(preemption or time limit\): finishing step "
                                     r"(\d+), saving, then exiting with code 75", said).group(1))
    saved = f"step_{stopped_after:06d}"
    assert f"dsmt train: error: [preempted] SIGTERM (preemption or time limit): every rank stopped after the same " \
           f"step, saved as {tmp_path / 'run' / 'checkpoints' / saved}; exit code 75" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert saved in complete_tags(tmp_path / "run" / "checkpoints")
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, stopped_after + 1))
    assert not still_running(job)

    resumed = run(spec)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, STEPS + 1))
    assert _losses(tmp_path / "run", range(1, STEPS + 1)) == _losses(reference, range(1, STEPS + 1))
