"""The fault handling's parts alone, without training: saves interrupted at each point, damaged manifests and the
fallback, the non-finite guard, the disk-full errors, the launcher's choice of the first failing rank, heartbeats,
the parent watchdog and the collective timeout."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from toolkit import backend
from train_helpers import FakeEngine
from toolkit.launch import heartbeat, identity, rank_output
from toolkit.launch.local import single_process_group
from toolkit.train.checkpoint import checkpoints, space
from toolkit.train.checkpoint.integrity import CheckpointDamaged
from toolkit.train.job.guard import StepGuard, TrainingDiverged
from toolkit.train.engine.hybrid import StepStats


class ShardedStandIn:
    """A layout-free state with one tensor: each save writes a real share of it (state/rank_00000.safetensors, its
    index and record, as toolkit/train/checkpoint/sharded.py does for a model); a resume reads the share back."""

    def take(self, *, copy):
        from toolkit.train.checkpoint.sharded import Share, rank_file

        values = torch.arange(64.0)
        tensors = {f"{state}/w/0": values + index for index, state in enumerate(("master", "exp_avg", "exp_avg_sq"))}
        share = Share(file=rank_file(0), tensors=tensors, boxes=[{"key": "w", "offset": [0], "shape": [64]}],
                      shapes={"w": [64]}, host_bytes=0)
        return share, {"layout": None}

    def files_to_read(self, tag_dir):
        return {"state/rank_00000.safetensors": 768, "state/index.json": 1, "dsmt_layout.json": 1,
                "dsmt_rng_rank0.pt": 1}

    def check(self, tag_dir):
        return {}

    def load(self, tag_dir):
        from safetensors.torch import load_file

        assert torch.equal(load_file(tag_dir / "state" / "rank_00000.safetensors")["master/w/0"], torch.arange(64.0))
        return json.loads((tag_dir / "dsmt_layout.json").read_text())


@pytest.fixture
def process_group():
    from toolkit.parallel.groups import Layout, init_process_groups

    with single_process_group(dist_backend=backend.current().dist_backend):
        init_process_groups(layout=Layout(), dist_backend=backend.current().dist_backend)
        yield


@pytest.mark.parametrize("files_before_crash", [0, 1, 3])
def test_a_save_interrupted_anywhere_never_blocks_the_next_or_a_resume(process_group, tmp_path, files_before_crash,
                                                                       monkeypatch):
    from toolkit.errors import DsmtError
    from toolkit.train.checkpoint import sharded

    def crashing_write(tag_dir, share):  # the writer killed after some of its files
        (tag_dir / "state").mkdir(exist_ok=True)
        for index in range(files_before_crash):
            (tag_dir / "state" / f"rank_{index:05d}.safetensors").write_bytes(b"x" * 100)
        raise RuntimeError("killed here")

    engine = FakeEngine()
    checkpoints.save(engine=engine, checkpoint_dir=tmp_path, step=4)
    monkeypatch.setattr(sharded, "write_share", crashing_write)
    with pytest.raises(DsmtError, match=r"\[checkpoint_io\] rank 0 could not write .*killed here"):
        checkpoints.save(engine=engine, checkpoint_dir=tmp_path, step=8, layout_free=ShardedStandIn())
    assert (tmp_path / ".partial-step_000008").is_dir() and not (tmp_path / "step_000008").exists()
    assert checkpoints.latest_complete(tmp_path) == "step_000004"
    assert checkpoints.resume(engine=engine, checkpoint_dir=tmp_path).step == 4
    assert (tmp_path / ".partial-step_000008").exists()  # a reader that does not hold the run lock changes nothing
    assert checkpoints.resume(engine=engine, checkpoint_dir=tmp_path, owner=True).step == 4
    assert not (tmp_path / ".partial-step_000008").exists()  # removed by the run that owns the directory
    (tmp_path / "step_000008" / "layout-free").mkdir(parents=True)  # an older dsmt's interrupted save
    checkpoints.save(engine=engine, checkpoint_dir=tmp_path, step=8)
    assert checkpoints.complete_tags(tmp_path) == ["step_000004", "step_000008"]
    assert json.loads((tmp_path / "step_000008" / "dsmt_manifest.json").read_text())["files"]


def test_saving_a_step_again_replaces_it(process_group, tmp_path):
    checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=4)
    checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=4)
    assert checkpoints.complete_tags(tmp_path) == ["step_000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest_complete", "step_000004"]


def test_damaged_checkpoint_falls_back_or_stops(process_group, tmp_path, capsys):
    engine = FakeEngine()
    for step in (4, 8):
        checkpoints.save(engine=engine, checkpoint_dir=tmp_path, step=step)
    (tmp_path / "step_000008" / "client.json").write_text('{"dsmt_step": 9}')  # same size, other bytes
    with pytest.raises(CheckpointDamaged, match=r"(?s)checkpoint_damaged.*step_000008.*client.json: digest"):
        checkpoints.resume(engine=engine, checkpoint_dir=tmp_path, fallback=False)
    assert checkpoints.resume(engine=engine, checkpoint_dir=tmp_path, owner=True).step == 4
    said = capsys.readouterr().out
    assert "falling back to step_000004" in said and ".damaged-step_000008" in said
    assert (tmp_path / ".damaged-step_000008").is_dir() and checkpoints.complete_tags(tmp_path) == ["step_000004"]
    (tmp_path / "step_000004" / "dsmt_manifest.json").unlink()  # the marker says one was written
    with pytest.raises(CheckpointDamaged, match="(?s)dsmt_manifest.json: missing.*no older complete checkpoint"):
        checkpoints.resume(engine=engine, checkpoint_dir=tmp_path)


def test_free_space_is_checked_before_a_save(process_group, tmp_path, monkeypatch):
    checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=4)
    monkeypatch.setattr(space, "free_bytes", lambda directory: 10)
    with pytest.raises(space.DiskFull, match=r"\[disk_full\] checkpoint step_000008 needs about .* 0.0 MB free"):
        checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=8)
    assert not (tmp_path / ".partial-step_000008").exists()


def test_disk_full_is_recognised_in_a_chain_and_nothing_else_is(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("dist_checkpointing failed") from inner
    except RuntimeError as err:
        chained = err
    full = space.as_disk_full(chained, directory=tmp_path, tag="step_000002", needed=4_400_000)
    assert full is not None and "4.4 MB" in str(full) and "fix:" in str(full)
    assert space.as_disk_full(ValueError("a bug"), directory=tmp_path, tag="step_000002", needed=None) is None


class FilesEngine(FakeEngine):
    """A DeepSpeed stand-in that writes a model state and an optimizer file (real torch files) beside client.json."""

    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)
        torch.save({"module": {"w": torch.arange(64.0)}}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")
        torch.save({"exp_avg": torch.ones(64)}, Path(save_dir) / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


DAMAGE = {  # file kind -> (path under the newest tag, how it is damaged)
    "marker": ("dsmt_complete.json", lambda p: p.write_text(p.read_text()[:20])),
    "marker-edited": ("dsmt_complete.json", lambda p: p.write_text(p.read_text().replace('"world_size": 1',
                                                                                         '"world_size": 2'))),
    "manifest": ("dsmt_manifest.json", lambda p: p.write_text(p.read_text()[:-30])),
    "rng": ("dsmt_rng_rank0.pt", lambda p: p.write_bytes(p.read_bytes()[:-10])),
    "state-shard": ("state/rank_00000.safetensors",
                    lambda p: p.write_bytes(p.read_bytes().replace(b"\x00\x00\x80\x3f", b"\x00\x00\x00\x40", 1))),
    "index": ("state/index.json", lambda p: p.write_bytes(p.read_bytes()[:-3])),
    "record": ("dsmt_layout.json", lambda p: p.write_text(p.read_text().replace("null", "1"))),
    "pointer": ("../latest_complete", lambda p: p.write_text("step_000004")),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_verify_and_resume_judge_every_file_kind_alike(process_group, tmp_path, capsys, kind):
    """Damage one file of the newest tag: `dsmt checkpoint verify` and resume name the same tags damaged and the
    same tag to resume from (the pointer is a hint: both take the newest intact tag and name the pointer)."""
    import argparse

    from toolkit.train.checkpoint import cli, manifest

    for step in (4, 8):
        checkpoints.save(engine=FilesEngine(), checkpoint_dir=tmp_path, step=step, layout_free=ShardedStandIn())
    name, damage = DAMAGE[kind]
    before = (tmp_path / "step_000008" / name).read_bytes()
    damage(tmp_path / "step_000008" / name)
    assert (tmp_path / "step_000008" / name).read_bytes() != before
    verdicts = manifest.verify_run(tmp_path)
    verify_damaged = {v.tag for v in verdicts if v.status == "damaged"}
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["checkpoint", "verify", str(tmp_path)])
    assert args.func(args) == (1 if verify_damaged else 0)
    said_by_verify = capsys.readouterr().out
    resumed = checkpoints.resume(engine=FilesEngine(), checkpoint_dir=tmp_path, layout_free=ShardedStandIn(),
                                 owner=True)
    said_by_resume = capsys.readouterr().out
    set_aside = {p.name.removeprefix(".damaged-") for p in tmp_path.glob(".damaged-*")}
    assert checkpoints.tag_for(resumed.step) == cli.resume_tag(verdicts)
    assert set_aside == verify_damaged == ({"step_000008"} if kind != "pointer" else set())
    if kind == "pointer":
        assert resumed.step == 8
        for said in (said_by_verify, said_by_resume):
            assert "latest_complete names 'step_000004', an older checkpoint" in said
    else:
        assert resumed.step == 4 and f"{name.split('/')[-1]}: " in said_by_verify
        assert "falling back to step_000004" in said_by_resume


def test_a_crafted_pickle_is_refused_by_name_and_never_run(process_group, tmp_path):
    """A model file whose pickle calls a function (manifest and marker rewritten to match): verify names it,
    resume refuses it before any load, and DeepSpeed's own load path refuses it too."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from toolkit.train.checkpoint import manifest, pickles

    checkpoints.save(engine=FilesEngine(), checkpoint_dir=tmp_path, step=4)
    tag_dir, ran = tmp_path / "step_000004", tmp_path / "code-ran"
    torch.save({"module": {}, "x": Crafted(ran)}, tag_dir / "mp_rank_00_model_states.pt")
    manifest.write_manifest(tag_dir, manifest.entries_for(tag_dir, manifest.list_files(tag_dir)))
    record = {k: v for k, v in json.loads((tag_dir / "dsmt_complete.json").read_text()).items()
              if not k.endswith("xxh3_128")}
    (tag_dir / "dsmt_complete.json").write_text(manifest.marker_text(tag_dir, record))
    [verdict] = manifest.verify_run(tag_dir)
    assert verdict.status == "unsafe"
    assert verdict.problems[0].line() == "mp_rank_00_model_states.pt: names builtins.getattr, pathlib.Path"
    with pytest.raises(pickles.UnsafeCheckpoint, match=r"^\[unsafe_checkpoint\] checkpoint .*step_000004 holds "
                       r"pickles that would run code(?s:.*)mp_rank_00_model_states.pt: names builtins.getattr"):
        checkpoints.resume(engine=FilesEngine(), checkpoint_dir=tmp_path)
    engine = FilesEngine()
    engine.checkpoint_engine = TorchCheckpointEngine()  # what DeepSpeed's load_checkpoint reads every file with
    with pickles.deepspeed_loads_weights_only(engine):
        with pytest.raises(pickles.UnsafeCheckpoint, match=r"mp_rank_00_model_states.pt names builtins.getattr"):
            engine.checkpoint_engine.load(str(tag_dir / "mp_rank_00_model_states.pt"))
    assert "load" not in vars(engine.checkpoint_engine) and not ran.exists()


class Crafted:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_deepspeeds_own_classes_load_weights_only(tmp_path):
    """Exactly what DeepSpeed pickles into a dsmt checkpoint's optimizer files loads under the allowlist."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from toolkit.train.checkpoint import pickles

    state = {"loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(2.0**16, 100, 1.0, 2, True),
             "zero_stage": ZeroStageEnum.weights, "param_slice_mappings": {"w": fragment_address(numel=4, start=8)}}
    torch.save(state, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert pickles.unsafe_files(tmp_path) == []
    loaded = pickles.load_weights_only(str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert [vars(loaded[key]) for key in ("loss_scaler", "dynamic")] == [vars(state[key])
                                                                         for key in ("loss_scaler", "dynamic")]
    assert loaded["zero_stage"] is ZeroStageEnum.weights and loaded["param_slice_mappings"]["w"].start == 8


@pytest.mark.parametrize("background", [False, True])
def test_a_disk_full_while_writing_the_state_is_named_and_keeps_the_previous_checkpoint(
        process_group, tmp_path, monkeypatch, background):
    """The writer (a thread in a background save) hits ENOSPC: every rank raises the named disk_full (at the next
    step for a background save: the step that saved had returned), never a traceback of the writer, and the
    previous checkpoint stays the newest complete one; the half-written folder is never published."""
    from toolkit.train.checkpoint import manifest, state_file, writer

    checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=4, layout_free=ShardedStandIn())

    def full(path, tensors, **kwargs):
        Path(path).write_bytes(b"x" * 100)  # a part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_file, "write_safetensors", full)
    if background:
        checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=8, layout_free=ShardedStandIn(),
                         background=True)
    with pytest.raises(space.DiskFull) as raised:
        if background:  # the step after: the writer is done, so the save is finished here, and fails
            writer.in_flight().thread.join()
            checkpoints.finish_save_if_written()
        else:
            checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=8, layout_free=ShardedStandIn())
    message = str(raised.value)
    assert message.startswith("[disk_full] the disk filled while saving checkpoint step_000008 into "), message
    assert "the previous checkpoint is intact (the library said: OSError: [Errno 28] No space left" in message
    assert "Traceback" not in message and "\nfix: " in message
    assert [(v.tag, v.status) for v in manifest.verify_run(tmp_path)] == [
        ("step_000004", "intact"), (".partial-step_000008", "incomplete")]
    assert checkpoints.resume(engine=FakeEngine(), checkpoint_dir=tmp_path, layout_free=ShardedStandIn()).step == 4
    assert writer.in_flight() is None
    # The state's size is checked before it is written, at the first save too.
    monkeypatch.setattr(space, "free_bytes", lambda directory: 100)
    with pytest.raises(space.DiskFull, match=r"^\[disk_full\] the state of checkpoint step_000012 needs about "
                       r"0.0 MB and .* has 0.0 MB free; nothing of it was written"):
        checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path / "first", step=12,
                         layout_free=ShardedStandIn())


def _stats(loss, norm=1.0):
    return StepStats(loss=loss, grad_norm=norm, lr=1e-3, step_time_s=0.1)


def test_non_finite_stops_bf16_and_fp32(process_group):
    guard = StepGuard(precision="bf16", max_skipped_steps=3, last_checkpoint="step_000004", engine=object())
    guard.check(step=5, stats=_stats(5.0), engine=None)
    with pytest.raises(TrainingDiverged, match=r"non_finite_loss\] step 6: loss 5.0, grad norm inf .*step_000004"):
        guard.check(step=6, stats=_stats(5.0, float("inf")), engine=None)
    assert TrainingDiverged.exit_code == 3


def test_fp16_skips_are_normal_until_too_many_in_a_row(process_group):
    class Engine:
        skipped_steps = 0

    engine = Engine()
    guard = StepGuard(precision="fp16", max_skipped_steps=3, last_checkpoint=None, engine=engine)
    for step, skipped in enumerate([1, 1, 0, 1, 1], start=1):  # two in a row, a good step, two in a row
        engine.skipped_steps += skipped
        guard.check(step=step, stats=_stats(float("nan")), engine=engine)
    engine.skipped_steps += 1
    with pytest.raises(TrainingDiverged, match=r"too_many_skipped_steps\] step 6: .* 3 steps in a row"):
        guard.check(step=6, stats=_stats(float("nan")), engine=engine)


def _report(log_dir, **fields):
    record = {"host": "node1", "command": "dsmt train", "traceback": "", "exit_code": 1, "time": time.time(),
              "consequence": False, "suspects": [], **fields}
    (log_dir / f"rank{record['rank']}.error.json").write_text(json.dumps(record))


def test_the_launcher_names_the_rank_that_failed_first(tmp_path):
    (tmp_path / "launcher.log").write_text("Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
                                           "  exitcode  : -9\n")
    _report(tmp_path, rank=0, message="RuntimeError: Connection reset by peer\n  rank 1 failed first: gone",
            consequence=True, suspects=[1])
    error = rank_output.launched_failure(log_dir=tmp_path, nprocs=2, returncode=1)
    assert str(error).startswith("rank 1 of 2 failed first (killed by SIGKILL)"), str(error)
    assert "rank 0 on node1 then saw: RuntimeError: Connection reset by peer" in str(error)
    # A rank's own error (a cause) outranks an earlier consequence on another rank.
    _report(tmp_path, rank=2, message="[disk_full] no space", time=time.time() + 5)
    assert str(rank_output.launched_failure(log_dir=tmp_path, nprocs=3, returncode=1)).startswith("rank 2 of 3")
    (tmp_path / "rank3.error.json").write_text("")  # a report cut short by a full disk
    assert "rank3.error.json is unreadable" in str(rank_output.launched_failure(log_dir=tmp_path, nprocs=4,
                                                                                returncode=1))


def test_heartbeats_tell_stopped_killed_and_silent_ranks(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        sleeper.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        mine = {"pid": sleeper.pid, **identity.here(), "phase": "step 3", "time": time.time()}
        assert "stopped" in heartbeat.why_silent(mine, now=time.time())
    finally:
        sleeper.kill()
        sleeper.wait()
    assert "exited or was killed" in heartbeat.why_silent(mine, now=time.time())
    remote = {**mine, "host": "elsewhere", "time": time.time() - 60}
    assert "heartbeat stopped 60 s ago" in heartbeat.why_silent(remote, now=time.time())
    assert heartbeat.why_silent({**remote, "time": time.time()}, now=time.time()) is None
    other_container = {**mine, "pidns": -1, "time": time.time()}  # the same hostname, another PID namespace
    assert heartbeat.why_silent(other_container, now=time.time()) is None  # its pid means nothing here


def test_the_rank_that_stopped_beating_first_is_named_without_any_report(tmp_path):
    """NCCL's watchdog aborts every rank from C++ after the collective timeout: no report, only heartbeats."""
    now = time.time()
    for rank, last in ((0, now - 1), (1, now - 31), (2, now - 1.5)):
        (tmp_path / f"rank{rank}.heartbeat.json").write_text(json.dumps(
            {"rank": rank, "pid": 10 + rank, "host": "node", "time": last, "phase": "step 9", "launch": "a:1/x",
             "interval_s": 1.0}))
    (tmp_path / "launcher.log").write_text("Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
                                           "  exitcode  : -6\n")
    error = str(rank_output.launched_failure(log_dir=tmp_path, nprocs=3, returncode=1))
    assert error.startswith("rank 1 of 3 stalled first: its heartbeat stopped 30 s before"), error
    assert "rank 0 killed by SIGABRT" in error


def test_a_report_survives_a_full_disk(tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        monkeypatch.setattr(rank_output, "_log_dir", disk)
        monkeypatch.setenv("RANK", "1")
        rank_output._reserve_report()
        with pytest.raises(OSError):  # fill the disk
            (disk / "filler").write_bytes(b"x" * (2 << 20))
        rank_output._write_report({"rank": 1, "message": "[disk_full] ...", "traceback": "t" * 200_000})
        report = json.loads((disk / "rank1.error.json").read_text())
        assert report["message"] == "[disk_full] ..." and not (disk / "rank1.error.reserve").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


WATCHED = """
import subprocess, sys, time
from toolkit.launch.watchdog import die_with_parent
helper = subprocess.Popen(["sleep", "300"])
die_with_parent(what="rank 0")
print(helper.pid, flush=True)  # after the watch started: the test kills the launcher once it reads this
time.sleep(300)
"""


def test_a_rank_whose_launcher_dies_stops_with_its_helpers(tmp_path):
    import psutil

    middle = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; p = subprocess.Popen([sys.executable, "
                               f"'-c', {WATCHED!r}], stdout=subprocess.PIPE, text=True); print(p.pid, "
                               f"p.stdout.readline().strip(), flush=True); p.wait()"],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[3],
                              env={**os.environ, "TORCHELASTIC_RUN_ID": "none"})  # as under torchrun
    rank_pid, helper_pid = map(int, middle.stdout.readline().split())
    middle.kill()  # the launcher dies; the rank is re-parented
    middle.wait()
    gone = psutil.wait_procs([psutil.Process(rank_pid), psutil.Process(helper_pid)], timeout=10)[1]
    assert not [p for p in gone if p.status() != psutil.STATUS_ZOMBIE]


def test_only_a_launchers_child_is_watched():
    from toolkit.launch.watchdog import started_by_launcher

    assert started_by_launcher({"TORCHELASTIC_RUN_ID": "none"}) and started_by_launcher({"SLURM_STEP_ID": "0"})
    assert not started_by_launcher({"RANK": "0", "WORLD_SIZE": "1"})  # by hand from a shell (nohup ... &)


def test_every_process_group_gets_the_collective_timeout(monkeypatch):
    from megatron.core import parallel_state

    from toolkit.parallel import groups
    from toolkit.parallel.groups import Layout
    from toolkit.spec.schema import TrainingSpec
    from toolkit.train.job.run import collective_timeout_s

    seen = {}
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kwargs: seen.update(kwargs))
    with single_process_group(dist_backend="gloo"):
        groups.init_process_groups(layout=Layout(), dist_backend="gloo", timeout_s=90.0)
    assert seen["distributed_timeout_minutes"] == pytest.approx(1.5)
    assert torch.distributed.is_available()
    def spec(**training):
        return type("Spec", (), {"training": TrainingSpec(**training)})

    assert collective_timeout_s(spec=spec(collective_timeout_s=7), dist_backend="gloo") == 7.0
    assert collective_timeout_s(spec=spec(), dist_backend="nccl") == 600.0
    assert collective_timeout_s(spec=spec(), dist_backend="gloo") == 180.0
    # A save's wait for its slowest writer lengthens the default: 405B on 8 nodes of 8 is 607 GB of state per node,
    # 304 s at the assumed 2 GB/s per node, x3 + 60 s; an 8B model stays at the floor
    def on(nodes, **training):
        cluster = type("Cluster", (), {"nodes": nodes, "gpus_per_node": 8})
        return type("Spec", (), {"training": TrainingSpec(**training), "cluster": cluster})

    big, small = (type("Shape", (), {"num_params": lambda self, n=n: n})() for n in (405e9, 8e9))
    assert collective_timeout_s(spec=on(8), dist_backend="nccl", model=big) == pytest.approx(3 * 607.5 / 2 + 60)
    assert collective_timeout_s(spec=on(8), dist_backend="nccl", model=small) == 600.0
    assert collective_timeout_s(spec=on(8, collective_timeout_s=7), dist_backend="nccl", model=big) == 7.0


def test_the_disk_full_search_visits_each_failure_once_and_skips_the_wrapper():
    """torch's CheckpointException carries each rank's failure, whose context may lead back to the wrapper: the
    search ends (it recursed without end) and answers with the failure, not the wrapper naming a rank."""
    import errno

    from toolkit.errors import disk_full_cause

    class Wrapper(BaseException):
        def __init__(self, failures):
            super().__init__("CheckpointException ranks:dict_keys([0]) No space left on device (RANK 0)")
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device")
    other = OSError("disk went away")
    for inner, expected in ((full, full), (other, None)):
        wrapper = Wrapper({0: (inner, "traceback")})
        inner.__context__ = wrapper  # the cycle
        assert disk_full_cause(wrapper) is expected
