"""`dsmt train SPEC --dry-run`: every check `dsmt train` makes before launching, all problems at once, nothing written."""

from pathlib import Path

import pytest
import yaml

from toolkit.cli import main as dsmt
from toolkit.check.dryrun import dry_run

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"

TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 256}


def cpu_spec(*, output_dir, model=None, parallel=None, data=None, gpus=2) -> dict:
    return {"model": model or {"config": dict(TINY_CONFIG)},
            "cluster": {"gpus_per_node": gpus, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "parallel": {"tp": 1, "pp": 1, "zero_stage": 1, **(parallel or {})},
            "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32",
                         "warmup_steps": 1, "train_steps": 4, "checkpoint_interval": 4, "output_dir": str(output_dir)},
            "data": data or {"synthetic": True}}


def write(path, raw) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_passes_the_dry_run(path):
    import torch.distributed as dist

    report = dry_run(path)
    assert report.ok, report.to_text()
    rules = report.rules("info")
    assert {"model", "model_build", "deepspeed_config", "data"} <= rules, report.to_text()
    assert not dist.is_initialized()  # the meta build's fake process group is gone


PLANS = {  # model, nodes, gpus per node, gpu, seq, global batch
    "llama3-8b-1x8": ["llama3-8b", "1", "8", "h100-80gb", "4096", "64"],
    "llama3-70b-8x8": ["llama3-70b", "8", "8", "h100-80gb", "4096", "1024"],
    "qwen2-7b-2x8-a100": ["qwen2-7b", "2", "8", "a100-80gb", "4096", "256"],
    "mistral-7b-1x4-a100-40": ["mistral-7b", "1", "4", "a100-40gb", "2048", "32"],
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_specs_emitted_by_plan_pass_the_dry_run(name, tmp_path, capsys):
    model, nodes, gpus, gpu, seq, batch = PLANS[name]
    path = tmp_path / "job.yaml"
    assert dsmt(["plan", model, "--nodes", nodes, "--gpus-per-node", gpus, "--gpu", gpu, "--seq-len", seq,
                 "--global-batch", batch, "--emit-spec", str(path)]) == 0
    report = dry_run(path)
    assert report.ok, report.to_text()
    assert "model_build" in report.rules("info")


def test_positional_spec_dry_run_prints_a_summary_and_exits_0(tmp_path, capsys):
    out = tmp_path / "out"
    assert dsmt(["train", write(tmp_path / "job.yaml", cpu_spec(output_dir=out)), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "OK (0 errors" in text and "[model_build]" in text and "accepts ds_config" in text
    assert not out.exists()


def test_model_that_does_not_fit_the_layout_lists_every_problem(tmp_path, capsys):
    out = tmp_path / "out"
    spec = write(tmp_path / "job.yaml", cpu_spec(output_dir=out, parallel={"tp": 3}, gpus=3))
    assert dsmt(["train", spec, "--dry-run"]) == 2
    text = capsys.readouterr().out
    for rule in ("heads_vs_tp", "kv_heads_vs_tp", "ffn_vs_tp", "vocab_padding"):
        assert f"error   [{rule}]" in text, text
    assert "tp=3 does not divide num_attention_heads=4" in text and "valid tp: 1" in text
    assert "model build: skipped" in text
    assert not out.exists()


def test_missing_data_and_tokenizer_are_each_reported(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    raw = cpu_spec(output_dir=out, model={"builtin": "tiny-llama"},
                   data={"path": str(tmp_path / "missing.jsonl"), "tokenizer": str(tmp_path / "no-tokenizer")})
    assert dsmt(["train", write(tmp_path / "job.yaml", raw), "--dry-run"]) == 2
    text = capsys.readouterr().out
    assert "error   [data_path_missing] data.path=" in text and "missing.jsonl does not exist" in text
    assert text.count("missing.jsonl does not exist") == 1  # dsmt check's finding, not once more as unreadable
    assert "error   [tokenizer]" in text and "no-tokenizer" in text
    assert "[model_build]" in text and "accepts ds_config" in text  # the checks that could run, ran
    assert not out.exists()


def test_real_data_with_a_checkpoint_and_a_fitting_tokenizer_passes(tiny_llama, tmp_path):
    raw = cpu_spec(output_dir=tmp_path / "out", model={"path": str(tiny_llama)}, data={"path": str(STORIES)})
    report = dry_run(write(tmp_path / "job.yaml", raw))
    assert report.ok, report.to_text()
    messages = " ".join(p.message for p in report.problems)
    assert "records" in messages and "250 tokens, fits vocab_size=250" in messages and "hf checkpoint" in messages


def test_builtin_with_a_tokenizer_too_large_for_the_shape(tmp_path):
    from toolkit.models.tiny import make_tiny_checkpoint

    big = make_tiny_checkpoint(tmp_path / "big", vocab_size=300)
    raw = cpu_spec(output_dir=tmp_path / "out", model={"builtin": "tiny-llama"},
                   data={"path": str(STORIES), "tokenizer": str(big)})
    report = dry_run(write(tmp_path / "job.yaml", raw))
    assert "tokenizer_vocab" in report.rules("error"), report.to_text()


def test_trainer_refusals_and_deepspeed_parser_are_consulted(monkeypatch, tmp_path):
    # sequence parallelism is trained now (tests/train/engine/test_train_sp.py): no trainer refusal, the model builds
    sp_spec = cpu_spec(output_dir=tmp_path / "sp-out", parallel={"tp": 2, "sequence_parallel": True})
    report = dry_run(write(tmp_path / "sp.yaml", sp_spec))
    assert "sequence_parallel_not_wired" not in report.rules("error") and "model_build" in report.rules("info")
    from toolkit.generate import deepspeed_config

    real = deepspeed_config.build_deepspeed_config
    monkeypatch.setattr(deepspeed_config, "build_deepspeed_config",
                        lambda **kw: {**real(**kw), "train_batch_size": 7})  # not micro × accum × dp
    report = dry_run(write(tmp_path / "job.yaml", cpu_spec(output_dir=tmp_path / "out")))
    assert "deepspeed_config" in report.rules("error"), report.to_text()


def test_bad_command_lines_get_named_errors(tmp_path, capsys):
    assert dsmt(["train", "--dry-run"]) == 2
    assert "no job spec" in capsys.readouterr().err
    assert dsmt(["train", "a.yaml", "--config", "b.yaml", "--dry-run"]) == 2
    assert "two job specs" in capsys.readouterr().err
    assert dsmt(["train", str(tmp_path / "nope.yaml"), "--dry-run"]) == 2
    assert "cannot read job spec" in capsys.readouterr().err


def test_inline_config_without_model_type_is_reported(tmp_path):
    config = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    report = dry_run(write(tmp_path / "job.yaml", cpu_spec(output_dir=tmp_path / "out", model={"config": config})))
    assert "model_config" in report.rules("error") and "model_type" in report.to_text()


def test_a_model_without_an_adapter_dry_runs_its_own_task_data(tmp_path):
    """An image classifier on an image folder: the dry run builds the examples as a rank would (no tokenizer asked
    for); a folder with one class is refused by the task's rule."""
    from test_train_plain_check import image_folder, tiny_resnet, write_spec

    model = tiny_resnet(tmp_path / "m")
    good = write_spec(tmp_path, model_dir=model, data={"path": str(image_folder(tmp_path / "i"))})
    report = dry_run(good)
    assert report.ok, report.to_text()
    assert any(p.rule == "data" and "6 examples for image_classification" in p.message for p in report.problems)
    (tmp_path / "bad").mkdir()
    bad = write_spec(tmp_path / "bad", model_dir=model, data={"path": str(image_folder(tmp_path / "one", classes=("a",)))})
    report = dry_run(bad)
    assert not report.ok and "tokenizer" not in report.rules(), report.to_text()
    assert any("one class" in p.message or "1 class" in p.message for p in report.errors), report.to_text()
