"""Weights & Biases through DeepSpeed's wandb monitor (`training.wandb`): a real 2-rank `dsmt train` run offline,
read back from the run's own `.wandb` file; the `wandb_missing` and `wandb_value` rules.

wandb >= 0.2x has no Python reader for offline runs any more (the datastore moved into its Go `wandb-core`), and
offline runs write no wandb-summary.json, so `wandb_records` reads the `.wandb` file itself: wandb's transaction
log (LevelDB's log format after a 7-byte ":W&B" header) of `wandb.proto.wandb_internal_pb2.Record` messages."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.check.checks import run_checks
from toolkit.spec.load import validate_spec
from toolkit.errors import SpecError

REPO = Path(__file__).resolve().parents[3]
STEPS = 3
GLOBAL_BATCH = 4
BLOCK_BYTES = 32 * 1024  # LevelDB log block; a record's 7-byte header never straddles one
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every Record in a `.wandb` file, in order (chunks of one record joined)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        left_in_block = BLOCK_BYTES - offset % BLOCK_BYTES
        if left_in_block < 7:  # the block's zero padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0:  # zeros up to the block end: the writer padded it
            offset += left_in_block
            continue
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_by_step(records: list) -> dict[int, dict[str, float]]:
    """step (samples seen) -> {key: value} over the history records (wandb merges logs at one step)."""
    import json

    history: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    return history


@pytest.fixture(scope="module")
def offline_run(tiny_llama, tmp_path_factory):
    """One 2-rank (dp 2) `dsmt train` run with training.wandb, WANDB_MODE=offline into a fresh WANDB_DIR."""
    from train_helpers import write_spec

    from toolkit.check.prelaunch import checked_file_before_launch
    from toolkit.train.job.launch import launch_training

    root = tmp_path_factory.mktemp("wandb-run")
    wandb_dir = root / "wandb-dir"
    wandb_dir.mkdir()
    spec = write_spec(root / "job.yaml", model_dir=tiny_llama, output_dir=root / "out", dp=2, micro=1,
                      global_batch=GLOBAL_BATCH, steps=STEPS, extra={"training": {
                          "grad_clip": 1.0, "wandb": {"project": "dsmt-test", "name": "tiny"}}})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_DIR", str(wandb_dir))
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("WANDB_NAME", raising=False)
        launch_training(job=checked_file_before_launch(path=str(spec), overrides=(), run_dir=None), spec_file=spec)
    return root / "out", wandb_dir


def test_offline_run_holds_the_losses_dsmt_logged(offline_run):
    from train_helpers import read_metrics

    output_dir, wandb_dir = offline_run
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only: DeepSpeed's MonitorMaster makes no monitor on the other ranks
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    run = [r.run for r in records if r.WhichOneof("record_type") == "run"][0]
    assert (run.display_name, run.project) == ("tiny", "dsmt-test")
    history = history_by_step(records)
    metrics = read_metrics(output_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for line in metrics:
        logged = history[line["step"] * GLOBAL_BATCH]  # DeepSpeed's monitors plot against samples seen
        assert logged["Train/Samples/train_loss"] == pytest.approx(line["loss"], rel=1e-6)
        assert logged["Train/Samples/grad_norm"] == pytest.approx(line["grad_norm"], rel=1e-6)
        assert "Train/Samples/lr" in logged  # DeepSpeed's engine logs the scheduler's lr after each step


def test_wandb_missing_is_an_error_naming_the_extra(monkeypatch):
    raw = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    raw["training"]["wandb"] = {"project": "dsmt-test"}
    spec = validate_spec(raw, source="tiny-cpu")
    assert "wandb_missing" not in run_checks(spec=spec).rules("error")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    report = run_checks(spec=spec)
    assert report.rules("error") == {"wandb_missing"}, report.to_text()
    assert "pip install 'dsmt[wandb]'" in report.to_text()
    raw["training"]["wandb"] = None
    assert "wandb_missing" not in run_checks(spec=validate_spec(raw, source="tiny-cpu")).rules("error")


@pytest.mark.parametrize("wandb, rule", [({"project": "team/proj"}, "wandb_value"),
                                          ({"project": "p", "name": "run name"}, "wandb_value"),
                                          ({"name": "tiny"}, "missing_key")])
def test_wandb_names_are_checked(wandb, rule):
    raw = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    raw["training"]["wandb"] = wandb
    with pytest.raises(SpecError) as raised:
        validate_spec(raw, source="tiny-cpu")
    assert raised.value.report.rules("error") == {rule}, raised.value.report.to_text()
