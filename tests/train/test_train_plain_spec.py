"""`dsmt train` on an HF model without a megatron adapter (a tiny ResNet): DeepSpeed data parallelism only."""

import json

import pytest
import yaml

from toolkit.cli import main as dsmt

pytestmark = pytest.mark.multiproc


def tiny_resnet(path):
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=32)
    ResNetForImageClassification(config).save_pretrained(path)
    return path


def spec_for(tmp_path, model_dir, **parallel):
    spec = {"model": {"path": str(model_dir)},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "parallel": {"tp": 1, "pp": 1, "zero_stage": 1, **parallel},
            "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 16, "precision": "fp32",
                         "lr": 1e-3, "min_lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 0, "train_steps": 3,
                         "checkpoint_interval": 3, "log_interval": 1, "output_dir": str(tmp_path / "out")},
            "data": {"synthetic": True}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_resnet_trains_with_deepspeed_only_and_exports(tmp_path, capfd):
    model_dir = tiny_resnet(tmp_path / "resnet")
    assert dsmt(["train", "--config", str(spec_for(tmp_path, model_dir))]) == 0
    out = capfd.readouterr().out
    assert "model_type resnet has no megatron-core adapter: training with DeepSpeed ZeRO-1 data parallelism only" in out
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    from transformers import AutoModelForImageClassification

    AutoModelForImageClassification.from_pretrained(tmp_path / "out" / "final-hf")


def test_resnet_with_tensor_parallel_is_refused_before_launch(tmp_path, capsys):
    model_dir = tiny_resnet(tmp_path / "resnet")
    assert dsmt(["train", "--config", str(spec_for(tmp_path, model_dir, tp=2))]) != 0
    assert "plain_model_layout" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
