"""One output directory, one run (toolkit/train/job/run_identity.py): a spec that would continue another job's
checkpoints is refused before any rank starts, naming each difference; what may change on purpose continues with
--continue-with-changes; data files are compared by content."""

import json

import pytest
import yaml

from toolkit.cli import main as dsmt
from toolkit.errors import DsmtError
from toolkit.spec.load import validate_spec
from toolkit.train.job import run_identity

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 256}


def raw_spec(tmp_path, **training) -> dict:
    return {"model": {"config": dict(TINY)},
            "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32",
                         "warmup_steps": 1, "train_steps": 4, "checkpoint_interval": 4,
                         "output_dir": str(tmp_path / "out"), **training},
            "data": {"path": str(tmp_path / "a.jsonl")}}


def spec_of(raw):
    return validate_spec(raw, source="test")


def a_finished_run(tmp_path, raw) -> None:
    """Record `raw` as the output directory's job and give it a complete checkpoint."""
    run_identity.admit(spec=spec_of(raw))
    tag = tmp_path / "out" / "checkpoints" / "step_000004"
    tag.mkdir(parents=True)
    (tag / "dsmt_complete.json").write_text("{}")


@pytest.fixture
def data(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "the cat drinks milk."}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "the dog eats bones."}\n')
    return tmp_path


def test_another_data_file_lr_and_seq_length_are_refused_naming_each(data):
    a_finished_run(data, raw_spec(data))
    other = raw_spec(data, lr=1e-3, seq_length=64)
    other["data"]["path"] = str(data / "b.jsonl")
    with pytest.raises(DsmtError) as err:
        run_identity.check(spec=spec_of(other), allow_changes=True)  # not even on purpose: another job
    text = str(err.value)
    assert text.startswith(f"[{run_identity.RULE}]")
    for key in ("data.path", "training.lr", "training.seq_length"):
        assert f"  {key}: " in text, text
    assert "new training.output_dir" in text and "accepts only" in text


def test_the_same_job_again_continues_and_a_moved_data_file_is_the_same_job(data):
    a_finished_run(data, raw_spec(data))
    assert run_identity.check(spec=spec_of(raw_spec(data)))[1] == []
    (data / "moved.jsonl").write_bytes((data / "a.jsonl").read_bytes())
    moved = raw_spec(data)
    moved["data"]["path"] = str(data / "moved.jsonl")
    assert run_identity.check(spec=spec_of(moved))[1] == []
    (data / "a.jsonl").write_text('{"text": "the cat drinks tea."}\n')  # same name, other content
    with pytest.raises(DsmtError, match=r"data.path: .*a.jsonl \(33:.*a.jsonl \(32:"):
        run_identity.check(spec=spec_of(raw_spec(data)))


def test_train_steps_and_layout_continue_only_on_purpose_and_are_recorded(data):
    a_finished_run(data, raw_spec(data))
    longer = raw_spec(data, train_steps=8)
    longer["parallel"] = {"zero_stage": 2}
    with pytest.raises(DsmtError) as err:
        run_identity.check(spec=spec_of(longer))
    assert "training.train_steps: 4 -> 8" in str(err.value) and "add --continue-with-changes" in str(err.value)
    accepted = run_identity.admit(spec=spec_of(longer), allow_changes=True)
    assert [key for key, _, _ in accepted] == ["parallel.zero_stage", "training.train_steps"]
    record = json.loads((data / "out" / run_identity.IDENTITY_FILE).read_text())
    assert record["changes"][-1]["keys"] == ["parallel.zero_stage", "training.train_steps"]
    assert run_identity.check(spec=spec_of(longer))[1] == []  # now this is the run's spec


def test_global_batch_and_model_shape_are_refused_and_logging_is_free(data):
    a_finished_run(data, raw_spec(data))
    bigger = raw_spec(data, global_batch_size=16, log_interval=1, checkpoint_interval=2)
    bigger["model"]["config"]["hidden_size"] = 128
    with pytest.raises(DsmtError) as err:
        run_identity.check(spec=spec_of(bigger), allow_changes=True)
    text = str(err.value)
    assert "training.global_batch_size: 8 -> 16" in text and "model.config.hidden_size: 64 -> 128" in text
    assert "log_interval" not in text and "checkpoint_interval" not in text


def test_plumbing_is_free_sections_whole_and_an_older_record_is_read_with_todays_defaults(data):
    """cluster.slurm / hosts / wandb change between a preemption and its resume; a record written by an older dsmt
    lacks the settings added since (they take their defaults); communication dtypes pick DeepSpeed's optimizer
    wrapper (its state's layout), so they are not free; a derived global batch says how to keep it."""
    a_finished_run(data, raw_spec(data))
    plumbing = raw_spec(data, wandb={"project": "p"})
    plumbing["cluster"].update(hosts=["node9"], slurm={"time": "48:00:00", "partition": "long"})
    assert run_identity.check(spec=spec_of(plumbing))[1] == []
    path = data / "out" / run_identity.IDENTITY_FILE
    record = json.loads(path.read_text())
    del record["spec"]["training"]["seed"], record["settings"]["training.seed"]  # as if seed came later
    path.write_text(json.dumps(record))
    assert run_identity.check(spec=spec_of(raw_spec(data)))[1] == []
    dtype = raw_spec(data)
    dtype["communication"] = {"grad_accum_dtype": "bf16"}
    with pytest.raises(DsmtError, match=r"communication.grad_accum_dtype: None -> 'bf16'"):
        run_identity.check(spec=spec_of(dtype), allow_changes=True)
    (data / "out" / run_identity.IDENTITY_FILE).unlink()
    run_identity.admit(spec=spec_of(raw_spec(data, global_batch_size=None)))  # one micro-batch of 2 per rank: 4
    derived = raw_spec(data, global_batch_size=None, micro_batch_size=4)
    with pytest.raises(DsmtError, match=r"global_batch_size: 4 -> 8  \(derived .* set training.global_batch_size: 4"):
        run_identity.check(spec=spec_of(derived), allow_changes=True)


def test_a_directory_without_a_run_takes_any_spec_and_an_older_runs_resolved_spec_is_compared(data):
    run_identity.admit(spec=spec_of(raw_spec(data)))  # a first launch that failed before its first checkpoint
    assert run_identity.admit(spec=spec_of(raw_spec(data, lr=1e-3))) == []
    (data / "out" / run_identity.IDENTITY_FILE).unlink()  # an output_dir of an older dsmt
    resolved = data / "out" / "resolved"
    resolved.mkdir()
    (resolved / "job.resolved.yaml").write_text(yaml.safe_dump(raw_spec(data)))
    tag = data / "out" / "checkpoints" / "step_000004"
    tag.mkdir(parents=True)
    (tag / "dsmt_complete.json").write_text("{}")
    with pytest.raises(DsmtError, match=r"training.lr: 0.0003 -> 0.001"):
        run_identity.check(spec=spec_of(raw_spec(data, lr=1e-3)))
    (data / "out" / run_identity.IDENTITY_FILE).write_text("{trunc")
    with pytest.raises(DsmtError, match=r"dsmt_run.json is unreadable"):
        run_identity.check(spec=spec_of(raw_spec(data)))


def test_dsmt_train_refuses_before_any_rank_starts_and_the_dry_run_names_it(data, monkeypatch, capsys):
    import toolkit.launch.local as local
    from toolkit.check.job import check_job_file
    from toolkit.train.job.launch import launch_training
    from toolkit.check.dryrun import dry_run

    a_finished_run(data, raw_spec(data))
    started = []
    monkeypatch.setattr(local, "launch_local_workers", lambda **kwargs: started.append(kwargs))
    job = data / "job.yaml"
    job.write_text(yaml.safe_dump(raw_spec(data, train_steps=8)))
    assert dsmt(["train", str(job)]) == 2
    assert not started
    said = capsys.readouterr()
    assert f"[{run_identity.RULE}]" in said.out + said.err and "training.train_steps: 4 -> 8" in said.out + said.err
    assert run_identity.RULE in dry_run(job).rules("error")
    # as `dsmt train --continue-with-changes`
    launch_training(job=check_job_file(job, continue_with_changes=True), spec_file=job)
    assert len(started) == 1 and "continuing with changes" in capsys.readouterr().out
