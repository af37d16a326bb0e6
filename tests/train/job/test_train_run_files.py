"""The run directory's files are what runs: ds_config.json / megatron.json against the spec
(toolkit/train/job/run_files.py).

Pure comparisons first; then the trainer's entry points (`python -m toolkit.train --run-dir`, `dsmt train --run-dir`,
`--dry-run`) with the launch stubbed out; last one real 1-rank CPU run of the generated torchrun script.
"""

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.cli import main as dsmt
from toolkit.train.job import run_files
from toolkit.train.job.run_files import ABSENT, RULE, RunFilesError, compare_run_files, flatten

REPO = Path(__file__).parents[3]
TINY = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def generate(tmp_path: Path, **training) -> Path:
    """`dsmt generate` of the tiny CPU spec at one rank (train_steps 1) into tmp_path/run."""
    raw = copy.deepcopy(TINY)
    raw["cluster"].update(gpus_per_node=1, master_port=_free_port())
    raw["training"].update(global_batch_size=4, seq_length=32, train_steps=1, warmup_steps=0, checkpoint_interval=1,
                           output_dir=str(tmp_path / "out"), **training)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    assert dsmt(["generate", str(spec), "--out", str(tmp_path / "run")]) == 0
    return tmp_path / "run"


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def resolved_spec(run: Path):
    from toolkit.spec.load import load_spec

    return load_spec(run / "job.resolved.yaml")


def test_a_fresh_run_dir_matches_its_spec(tmp_path, capsys):
    run = generate(tmp_path)
    files = compare_run_files(run_dir=run, spec=resolved_spec(run))
    assert files.differences == () and files.require_agreement(spec_ref="x") is files
    assert files.ds_config == json.loads((run / "ds_config.json").read_text())
    assert files.start_lines() == [f"dsmt train: {run}: ds_config.json and megatron.json match the spec"]


def test_tuning_edits_win_and_are_each_listed(tmp_path, capsys):
    run = generate(tmp_path)

    def tune(config):
        config["zero_optimization"]["reduce_bucket_size"] = 1234567
        config["optimizer"]["params"]["betas"] = [0.9, 0.98]
        config["zero_optimization"]["overlap_comm"] = not config["zero_optimization"]["overlap_comm"]
        del config["tensorboard"]
        config["flops_profiler"] = {"enabled": True}

    edit(run / "ds_config.json", tune)
    files = compare_run_files(run_dir=run, spec=resolved_spec(run)).require_agreement(spec_ref="job")
    assert files.contradictions == []
    assert {d.path for d in files.overrides} == {
        "zero_optimization.reduce_bucket_size", "optimizer.params.betas", "zero_optimization.overlap_comm",
        "tensorboard.enabled", "tensorboard.output_path", "tensorboard.job_name", "flops_profiler.enabled"}
    assert files.ds_config["zero_optimization"]["reduce_bucket_size"] == 1234567  # what deepspeed.initialize gets
    text = "\n".join(files.start_lines())
    assert "ds_config.json overrides the spec" in text
    assert "zero_optimization.reduce_bucket_size: file 1234567, spec 500000000 (the file wins)" in text
    assert "tensorboard.enabled: file <absent>, spec false (the file wins)" in text


@pytest.mark.parametrize("change,key,values,field", [
    (lambda c: c.update(train_micro_batch_size_per_gpu=1), "train_micro_batch_size_per_gpu", "file 1, spec 2",
     "training.micro_batch_size"),
    (lambda c: c["zero_optimization"].update(stage=2), "zero_optimization.stage", "file 2, spec 1",
     "parallel.zero_stage"),
    (lambda c: c["zero_optimization"].pop("stage"), "zero_optimization.stage",
     "file <absent> (DeepSpeed's default 0), spec 1", "parallel.zero_stage"),
    (lambda c: c.update(bf16={"enabled": True}), "bf16.enabled", "file true, spec false", "training.precision"),
    (lambda c: (c.pop("bf16"), c.update(bfloat16={"enabled": True})), "bf16.enabled", "file true, spec false",
     "training.precision"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu"}),
     "zero_optimization.offload_optimizer.device", 'file "cpu", spec "none"', "parallel.offload_optimizer"),
    (lambda c: c.pop("gradient_accumulation_steps"), "gradient_accumulation_steps", "file <absent>, spec 2", ""),
    # DeepSpeed would ignore it for dsmt's client scheduler (transformers'): refused rather than silently dropped
    (lambda c: c.update(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}}), "scheduler",
     'file {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, spec <absent>', "training.lr_schedule"),
])
def test_a_layout_key_contradiction_is_a_named_error(tmp_path, change, key, values, field):
    run = generate(tmp_path)
    edit(run / "ds_config.json", change)
    files = compare_run_files(run_dir=run, spec=resolved_spec(run))
    assert [d.path for d in files.contradictions] == [key]
    with pytest.raises(RunFilesError) as caught:
        files.require_agreement(spec_ref="job.yaml")
    message = str(caught.value)
    assert caught.value.rule == RULE and message.startswith(f"[{RULE}]")
    assert f"ds_config.json {key}: {values} (must agree" in message
    assert field in message and "dsmt generate SPEC --out" in message and "revert" in message


def test_harmless_spellings_of_the_same_value_are_not_contradictions(tmp_path):
    run = generate(tmp_path)
    edit(run / "ds_config.json", lambda c: (c.pop("fp16"), c.update(bfloat16={"enabled": True})))
    files = compare_run_files(run_dir=run, spec=resolved_spec(run))
    # no fp16 section means fp16 off; "bfloat16" is ignored by DeepSpeed while "bf16" is present: listed, no error
    assert files.contradictions == []
    assert {d.path for d in files.overrides} == {"fp16.enabled", "bfloat16.enabled"}


def test_every_megatron_json_edit_is_a_contradiction(tmp_path):
    run = generate(tmp_path)
    edit(run / "megatron.json", lambda s: s["transformer_config"].update(
        tensor_model_parallel_size=2, batch_p2p_sync=True, recompute_granularity="full"))
    with pytest.raises(RunFilesError) as caught:
        compare_run_files(run_dir=run, spec=resolved_spec(run)).require_agreement(spec_ref="job.yaml")
    message = str(caught.value)
    assert "megatron.json transformer_config.tensor_model_parallel_size: file 2, spec 1" in message
    assert 'megatron.json transformer_config.recompute_granularity: file "full", spec null' in message
    assert "megatron.json transformer_config.batch_p2p_sync: file true, spec false" in message
    assert "parallel.tp" in message and "training.recompute" in message


def test_unreadable_or_missing_files_are_named(tmp_path):
    run = generate(tmp_path)
    spec = resolved_spec(run)
    (run / "ds_config.json").write_text('{"train_batch_size": 4,')
    with pytest.raises(RunFilesError, match=r"\[run_files_unreadable\] .*ds_config.json is not readable JSON"):
        compare_run_files(run_dir=run, spec=spec)
    (run / "ds_config.json").unlink()
    missing = r"(?s)\[run_files_missing\] .*ds_config.json does not exist.*dsmt generate"
    with pytest.raises(RunFilesError, match=missing):
        compare_run_files(run_dir=run, spec=spec)


def test_flatten_and_json_equality():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}
    assert run_files.lookup({"a": {"b": 0}}, "a.b.c") is ABSENT
    assert not run_files._same(True, 1) and run_files._same(1.0, 1) and not run_files._same(ABSENT, None)


def test_trainer_main_passes_the_files_config_and_stops_on_a_contradiction(tmp_path, monkeypatch, capsys):
    from toolkit.train import __main__ as entry
    from toolkit.train.job import run as trainer

    run = generate(tmp_path)
    seen = []
    monkeypatch.setattr(trainer, "train", lambda *, job: seen.append(job))
    edit(run / "ds_config.json", lambda c: c.update(train_batch_size=8))
    with pytest.raises(RunFilesError, match="train_batch_size: file 8, spec 4"):
        entry.main(["--config", str(run / "job.resolved.yaml"), "--run-dir", str(run)])
    assert seen == [] and not (tmp_path / "out").exists()  # stopped before the run wrote anything
    edit(run / "ds_config.json", lambda c: (c.update(train_batch_size=4),
                                            c["zero_optimization"].update(reduce_bucket_size=1234567)))
    assert entry.main(["--run-dir", str(run)]) == 0  # the spec defaults to the run dir's job.resolved.yaml
    assert seen[0].deepspeed_config["zero_optimization"]["reduce_bucket_size"] == 1234567
    assert "zero_optimization.reduce_bucket_size: file 1234567" in capsys.readouterr().out
    assert entry.main(["--config", str(run / "job.resolved.yaml")]) == 0 and seen[1].run_dir is None  # no run dir
    assert seen[1].deepspeed_config["zero_optimization"]["reduce_bucket_size"] != 1234567  # the spec's own


def test_dsmt_train_run_dir_checks_before_launching(tmp_path, monkeypatch, capsys):
    import toolkit.launch.local

    run = generate(tmp_path)
    launched = []
    monkeypatch.setattr(toolkit.launch.local, "launch_local_workers", lambda **kw: launched.append(kw["args"]))
    edit(run / "megatron.json", lambda s: s["schedule"].update(micro_batch_size=1))
    assert dsmt(["train", "--run-dir", str(run)]) == 2
    assert f"[{RULE}]" in capsys.readouterr().err and launched == []
    edit(run / "megatron.json", lambda s: s["schedule"].update(micro_batch_size=2))
    assert dsmt(["train", "--run-dir", str(run)]) == 0
    assert launched == [["--config", str(run / "job.resolved.yaml"), "--run-dir", str(run)]]


def test_set_with_a_run_dir_is_refused(tmp_path, capsys):
    run = generate(tmp_path)
    assert dsmt(["train", "--run-dir", str(run), "--set", "training.lr=0.01", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "[run_dir_with_overrides] --set training.lr=0.01 with --run-dir" in err and "dsmt generate" in err


def test_dry_run_with_a_run_dir_reports_overrides_and_contradictions(tmp_path, capsys):
    run = generate(tmp_path)
    edit(run / "ds_config.json", lambda c: c["zero_optimization"].update(reduce_bucket_size=1234567))
    assert dsmt(["train", "--run-dir", str(run), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "[run_files_override] ds_config.json overrides the spec: ds_config.json zero_optimization." in text
    assert "accepts ds_config" in text
    edit(run / "ds_config.json", lambda c: c["zero_optimization"].update(stage=3))
    assert dsmt(["train", "--run-dir", str(run), "--dry-run"]) == 2
    text = capsys.readouterr().out
    assert f"error   [{RULE}]" in text and "zero_optimization.stage: file 3, spec 1" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.multiproc
def test_generated_script_trains_with_the_edited_config_and_refuses_a_contradiction(tmp_path):
    """One rank, one step, through the generated torchrun script: the tuning edit reaches DeepSpeed's engine
    (engine_probe is `python -m toolkit.train` recording the engine's configuration); then the real module stops
    on a contradiction with exit 2."""
    from toolkit.generate.writer import write_run_dir
    from toolkit.check.job import check_job

    run = generate(tmp_path)
    write_run_dir(job=check_job(resolved_spec(run)), out_dir=run, overwrite=True, train_module="engine_probe")
    edit(run / "ds_config.json", lambda c: c["zero_optimization"].update(reduce_bucket_size=1234567))
    probe = tmp_path / "probe"
    probe.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DSMT_ENGINE_PROBE": str(probe),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(REPO)])}  # engine_probe: tests/train
    result = subprocess.run(["bash", str(run / "launch_torchrun.sh")], capture_output=True, text=True, env=env,
                            timeout=480)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "zero_optimization.reduce_bucket_size: file 1234567, spec 500000000 (the file wins)" in log
    engine = json.loads((probe / "rank0.json").read_text())
    assert engine == {"reduce_bucket_size": 1234567, "zero_stage": 1, "train_micro_batch_size_per_gpu": 2}
    resolved = json.loads((tmp_path / "out" / "resolved" / "ds_config.json").read_text())
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 1234567
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [1]

    edit(run / "ds_config.json", lambda c: c.update(train_micro_batch_size_per_gpu=1))
    before = _tree(tmp_path)
    result = subprocess.run([sys.executable, "-m", "toolkit.train", "--config", str(run / "job.resolved.yaml"),
                             "--run-dir", str(run)], capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"[{RULE}]" in result.stderr and "train_micro_batch_size_per_gpu: file 1, spec 2" in result.stderr
    assert _tree(tmp_path) == before  # nothing written or half-written: no checkpoint, metrics or resolved files


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}
