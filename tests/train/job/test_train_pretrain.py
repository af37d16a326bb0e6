"""Pretraining a built-in shape (`model.builtin`): megatron-core's init, `data.tokenizer`, no init weights on disk."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from toolkit.cli import main as dsmt
from toolkit.spec.load import validate_spec
from train_helpers import STORIES, read_metrics


def builtin_spec(*, tokenizer, output_dir, builtin="tiny-llama", steps=8, **data) -> dict:
    return {
        "model": {"builtin": builtin},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
        "parallel": {"tp": 1, "pp": 1, "zero_stage": 1},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32",
                     "lr": 3e-3, "min_lr": 3e-3, "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                     "train_steps": steps, "checkpoint_interval": 100, "log_interval": 1, "seed": 11,
                     "output_dir": str(output_dir)},
        "data": {"path": str(STORIES), "tokenizer": None if tokenizer is None else str(tokenizer), **data},
    }


def write(path, raw) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def pretrained(tiny_llama, tmp_path_factory):
    """One 2-rank launch for every pretraining run of this file: 8 steps at ZeRO-1, and 4 steps at ZeRO-1 and 3."""
    from train_helpers import train_in_one_launch

    root = tmp_path_factory.mktemp("pretrain")
    runs = {"zero1-8": write(root / "job.yaml", builtin_spec(tokenizer=tiny_llama, output_dir=root / "out"))}
    for zero in (1, 3):
        raw = builtin_spec(tokenizer=tiny_llama, output_dir=root / f"zero{zero}", steps=4)
        raw["parallel"]["zero_stage"] = zero
        raw["communication"] = {"param_persistence_threshold_elements": 0}
        runs[f"zero{zero}"] = write(root / f"zero{zero}.yaml", raw)
    train_in_one_launch(runs={name: Path(path) for name, path in runs.items()}, root=root, nprocs=2)
    return root


@pytest.mark.multiproc
def test_builtin_shape_pretrains_from_megatron_init_and_exports(pretrained):
    out = pretrained / "out"
    losses = [m["loss"] for m in read_metrics(out)]
    assert len(losses) == 8
    assert abs(losses[0] - math.log(250)) < 0.3, losses  # a std-0.02 init predicts about uniformly
    assert losses[-1] < losses[0] - 0.5, losses
    # rank 0 wrote the shape's config and the tokenizer, never weights
    init_files = {p.name for p in (out / "init-hf").iterdir()}
    assert "config.json" in init_files and "tokenizer.json" in init_files
    assert not [n for n in init_files if n.endswith((".safetensors", ".bin"))], init_files
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final-hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out / "final-hf")
    assert (model.config.model_type, model.config.vocab_size, model.config.num_hidden_layers) == ("llama", 250, 4)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss < math.log(250)  # the trained weights, not a fresh init


def test_megatron_init_has_the_configured_std_and_exports_every_hf_tensor(tiny_llama, tmp_path):
    """One process: megatron-core's init method (normal(0, std), output projections std / sqrt(2 * layers))."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from toolkit import backend as backends
    from toolkit.adapters.load import canonical_tensors
    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import init_model_chunks
    from toolkit.parallel.groups import Layout
    from toolkit.train.job.pretrain import hf_config, write_init_dir

    spec = validate_spec(builtin_spec(tokenizer=tiny_llama, output_dir=tmp_path / "out"), source="test")
    init_dir = write_init_dir(tmp_path / "init-hf", spec=spec)
    assert hf_config("tiny-llama").initializer_range == 0.02  # what `dsmt train` passes as init_method_std
    std = 0.05  # not megatron's default (0.02), so a value that was not wired through would show
    backend = backends.current()
    with single_process_group(dist_backend=backend.dist_backend):
        parallel_state.initialize_model_parallel(1, 1)
        chunks, info = init_model_chunks(hf_dir=init_dir, layout=Layout(), params_dtype=torch.float32,
                                         init_method_std=std, seed=3)
        tensors = {name: t.detach().clone() for name, t in canonical_tensors(chunks).items()}
    num_layers = 4
    for name, tensor in tensors.items():
        if "norm" in name or "layer_norm" in name:
            assert torch.all(tensor == 1), name
            continue
        expected = std / math.sqrt(2 * num_layers) if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
        assert tensor.mean().abs() < 0.1 * expected, name
        assert abs(tensor.std().item() / expected - 1) < 0.06, (name, tensor.std().item(), expected)
    assert info.kind == "init" and info.hf_dir == init_dir
    hf_names = set(AutoModelForCausalLM.from_config(info.hf_config).state_dict())
    assert set(info.hf_tensor_dtypes()) == hf_names  # the export writes every HF tensor


def refused_before_launch(raw: dict, *, tmp_path, capsys) -> str:
    """`dsmt train` of `raw` exits 2 and writes nothing; returns what it printed on stderr."""
    assert dsmt(["train", write(tmp_path / "job.yaml", raw)]) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def test_builtin_text_data_without_tokenizer_is_refused_before_launch(tmp_path, capsys):
    err = refused_before_launch(builtin_spec(tokenizer=None, output_dir=tmp_path / "out"), tmp_path=tmp_path,
                                capsys=capsys)
    assert "builtin_needs_tokenizer" in err and "data.tokenizer" in err and "vocab_size=250" in err


def test_tokenizer_larger_than_the_shape_is_refused_by_name(tmp_path, capsys):
    from toolkit.models.tiny import make_tiny_checkpoint

    big = make_tiny_checkpoint(tmp_path / "big", vocab_size=300)  # its tokenizer has 300 tokens, the shape 250
    err = refused_before_launch(builtin_spec(tokenizer=big, output_dir=tmp_path / "out"), tmp_path=tmp_path,
                                capsys=capsys)
    assert "tokenizer_vocab" in err and "300 tokens" in err and "vocab_size=250" in err


def test_gpt_shapes_are_refused_by_name(tmp_path, capsys):
    raw = builtin_spec(tokenizer=None, output_dir=tmp_path / "out", builtin="gpt3-175b", path=None, synthetic=True)
    raw["cluster"]["gpus_per_node"] = 1
    raw["training"].update(global_batch_size=2)
    err = refused_before_launch(raw, tmp_path=tmp_path, capsys=capsys)
    assert "gpt3-175b" in err and "trainable shapes" in err and "llama3-8b" in err


def test_zero3_pretraining_builds_partitioned_with_the_same_init(tiny_llama, tmp_path, monkeypatch):
    """At ZeRO-3 megatron initialises each module and deepspeed.zero.Init partitions it at once: every parameter
    is a partition (threshold 0), and gathered it equals the unpartitioned init of the same seed, bit for bit."""
    import deepspeed
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.adapters.load import canonical_parameters
    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import init_model_chunks
    from toolkit.parallel.groups import Layout
    from toolkit.train.job.pretrain import write_init_dir

    monkeypatch.setenv("LOCAL_RANK", "0")
    spec = validate_spec(builtin_spec(tokenizer=tiny_llama, output_dir=tmp_path / "out"), source="test")
    init_dir = write_init_dir(tmp_path / "init-hf", spec=spec)
    zero3 = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with single_process_group(dist_backend=backends.current().dist_backend):
        parallel_state.initialize_model_parallel(1, 1)
        built = {}
        for name, config in (("whole", None), ("zero3", zero3)):
            chunks, _ = init_model_chunks(hf_dir=init_dir, layout=Layout(), params_dtype=torch.float32,
                                          init_method_std=0.02, seed=5, zero3_config=config)
            built[name] = canonical_parameters(chunks)
        partitioned = built["zero3"]
        assert all(p.numel() == 0 and p.ds_numel > 0 for p in partitioned.values())
        for name, param in partitioned.items():
            with deepspeed.zero.GatheredParameters([param]):
                assert torch.equal(param.data, built["whole"][name].data), name


@pytest.mark.multiproc
def test_builtin_shape_at_zero3_dp2_trains_like_zero1(pretrained):
    losses = {zero: [m["loss"] for m in read_metrics(pretrained / f"zero{zero}")] for zero in (1, 3)}
    print("zero1", losses[1], "zero3", losses[3])
    assert len(losses[3]) == 4 and losses[3] == pytest.approx(losses[1], abs=1e-5)
