"""Bad training configs fail before any process group starts, naming the rule and the fix."""

from toolkit.cli import main as dsmt
from train_helpers import write_spec


def test_zero2_with_pipeline_is_refused_before_launch(tiny_llama, tmp_path, capsys):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "out", pp=2, dp=2, zero=2)
    assert dsmt(["train", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "zero_with_pp" in err and "use zero_stage 1" in err
    assert not (tmp_path / "out").exists()


def test_batch_that_does_not_add_up_is_refused(tiny_llama, tmp_path, capsys):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "out", dp=2, micro=3,
                      global_batch=8)
    assert dsmt(["train", "--config", str(spec)]) != 0
    assert "batch_divisibility" in capsys.readouterr().err


def test_tp_not_dividing_heads_is_refused(tiny_llama, tmp_path, capsys):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "out", tp=3, dp=1)
    assert dsmt(["train", "--config", str(spec)]) != 0
    assert "heads_vs_tp" in capsys.readouterr().err


def test_builtin_shape_with_text_data_and_no_tokenizer_is_refused(tmp_path, capsys):
    """A built-in shape pretrains from megatron-core's init (test_train_pretrain.py), but has no tokenizer files."""
    import yaml

    from train_helpers import STORIES

    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"model": {"builtin": "llama3-8b"}, "cluster": {"gpus_per_node": 1, "gpu": "cpu", "device": "cpu"},
                                    "training": {"precision": "fp32", "seq_length": 32, "warmup_steps": 0, "train_steps": 2,
                                                 "output_dir": str(tmp_path / "out")},
                                    "data": {"path": str(STORIES)}}))
    code = dsmt(["train", "--config", str(spec)])
    err = capsys.readouterr().err
    assert code != 0 and "builtin_needs_tokenizer" in err and "model.builtin=llama3-8b" in err and "data.tokenizer" in err
    assert not (tmp_path / "out").exists()
