"""`dsmt check` / `dsmt train` on a model without a megatron-core adapter and real data (toolkit/check/plain_checks.py):
a good image folder passes; bad data is refused by rule name, exit 2, before any rank starts or anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from toolkit.cli import main as dsmt


def tiny_resnet(path, **config):
    from transformers import ResNetConfig, ResNetForImageClassification

    settings = dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=16)
    ResNetForImageClassification(ResNetConfig(**{**settings, **config})).save_pretrained(path)
    return path


def tiny_distilbert(path, *, head="SequenceClassification", **config):
    import transformers

    settings = dict(vocab_size=32, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=32)
    getattr(transformers, f"DistilBertFor{head}")(transformers.DistilBertConfig(**settings, **config)).save_pretrained(path)
    return path


def image_folder(root, classes=("a", "b", "c")):
    from PIL import Image

    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((8, 8, 3), 40 * i, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def write_spec(tmp_path, *, model_dir, data, **training):
    spec = {"model": {"path": str(model_dir)},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "parallel": {"tp": 1, "pp": 1, "zero_stage": 1},
            "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16, "precision": "fp32",
                         "warmup_steps": 0, "train_steps": 2, "output_dir": str(tmp_path / "out"), **training},
            "data": data}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_resnet_on_an_image_folder_passes_check(tmp_path, capsys):
    spec = write_spec(tmp_path, model_dir=tiny_resnet(tmp_path / "m"), data={"path": str(image_folder(tmp_path / "i"))})
    assert dsmt(["check", str(spec)]) == 0
    assert "task image_classification" in capsys.readouterr().out


def test_regression_on_jsonl_passes_check(tmp_path):
    model = tiny_distilbert(tmp_path / "m", num_labels=1)
    data = {"path": jsonl(tmp_path / "d.jsonl", [{"text": "a b", "score": 0.5}]), "label_field": "score"}
    assert dsmt(["check", str(write_spec(tmp_path, model_dir=model, data=data))]) == 0


CASES = {
    "one class": ("resnet", lambda t: {"path": str(image_folder(t / "i", classes=("only",)))}, {},
                  ["image_folder_classes", "1 class sub-folder(s) (only)"]),
    "more classes than labels": ("resnet", lambda t: {"path": str(image_folder(t / "i", classes="abcde"))}, {},
                                 ["num_labels", "has 5 classes", "num_labels=3"]),
    "corrupt image": ("resnet", lambda t: {"path": str(corrupt(image_folder(t / "i")))}, {},
                      ["unreadable_image", "b/1.png cannot be read"]),
    "sync batchnorm on cpu": ("resnet", lambda t: {"path": str(image_folder(t / "i"))}, {"sync_batchnorm": True},
                              ["sync_batchnorm_on_cpu", "GPU/XPU only"]),
    "label field missing": ("classifier", lambda t: {"path": jsonl(t / "d.jsonl", [{"text": "a", "y": 1}])}, {},
                            ["label_field", "record 1", "fields found: text, y"]),
    "label of wrong type": ("classifier", lambda t: {"path": jsonl(t / "d.jsonl", [{"text": "a", "label": 0.5}])},
                            {}, ["label_type", "label=0.5 is float"]),
    "labels beyond num_labels": ("classifier", lambda t: {"path": jsonl(t / "d.jsonl", [
        {"text": "a", "label": 4}, {"text": "b", "label": 0}])}, {}, ["num_labels", "{0, 4}", "num_labels=2"]),
    "unmapped head": ("qa", lambda t: {"path": jsonl(t / "d.jsonl", [{"text": "a"}])}, {},
                      ["plain_model_task", "DistilBertForQuestionAnswering", "*ForSequenceClassification"]),
}


def corrupt(folder):
    (folder / "b" / "1.png").write_bytes(b"not a png")
    return folder


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_refused_by_check_with_the_rule(case, tmp_path, capsys):
    model_kind, make_data, training, expected = CASES[case]
    model = {"resnet": lambda: tiny_resnet(tmp_path / "m"),
             "classifier": lambda: tiny_distilbert(tmp_path / "m", num_labels=2),
             "qa": lambda: tiny_distilbert(tmp_path / "m", head="QuestionAnswering")}[model_kind]()
    spec = write_spec(tmp_path, model_dir=model, data=make_data(tmp_path), **training)
    assert dsmt(["check", str(spec)]) == 2
    out = capsys.readouterr().out
    for text in expected:
        assert text in out, (text, out)


def test_train_refuses_bad_data_before_launch_and_writes_nothing(tmp_path, capsys):
    folder = image_folder(tmp_path / "i", classes=("only",))
    spec = write_spec(tmp_path, model_dir=tiny_resnet(tmp_path / "m"), data={"path": str(folder)})
    assert dsmt(["train", str(spec)]) == 2
    assert "image_folder_classes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_refuses_tensor_parallel_for_a_plain_model_before_launch(tmp_path, capsys):
    spec = write_spec(tmp_path, model_dir=tiny_resnet(tmp_path / "m"), data={"synthetic": True})
    assert dsmt(["train", str(spec), "--set", "parallel.tp=2", "--set", "cluster.gpus_per_node=4"]) == 2
    assert "plain_model_layout" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
