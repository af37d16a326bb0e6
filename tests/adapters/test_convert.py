"""Conversion both ways in this process: bit-exact round trips and every bad input named, nothing half-written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.cli import main as dsmt
from toolkit.tiny import make_tiny_checkpoint


def hf_state(directory):
    state = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def round_trip(source, tmp_path, *extra):
    assert dsmt(["convert", "hf-to-mcore", str(source), str(tmp_path / "mcore"), *extra]) == 0
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    return tmp_path / "mcore", tmp_path / "back"


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "qwen2", "qwen2_tied", "mistral"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(variant, tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    mcore, back = round_trip(tiny_checkpoints[variant], tmp_path)
    original, exported = hf_state(tiny_checkpoints[variant]), hf_state(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) and original[k].dtype == exported[k].dtype for k in original)
    assert json.loads((mcore / "dsmt_checkpoint.json").read_text())["padded_vocab_size"] == 256
    assert (back / "tokenizer.json").is_file() and (mcore / "hf" / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.config.model_type == tiny_checkpoints[variant].name.split("_")[0]


def test_bf16_sharded_checkpoint_round_trips_in_bf16_and_reshards(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "hf", dtype=torch.bfloat16, max_shard_size="40KB")
    assert (source / "model.safetensors.index.json").is_file()
    mcore, back = round_trip(source, tmp_path)
    assert json.loads((mcore / "dsmt_checkpoint.json").read_text())["params_dtype"] == "bfloat16"
    original, exported = hf_state(source), hf_state(back)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(original[k], exported[k]) for k in original)
    assert dsmt(["convert", "mcore-to-hf", str(mcore), str(tmp_path / "sharded"), "--max-shard-gb", "0.00003"]) == 0
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = hf_state(tmp_path / "sharded")
    assert all(torch.equal(original[k], exported[k]) for k in original)


def assert_fails(argv, capsys, *fragments):
    code = dsmt(argv)
    err = capsys.readouterr().err
    assert code != 0, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def no_partial_output(tmp_path, name="out"):
    return not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}.*"))


def test_missing_and_unreadable_config(tmp_path, capsys):
    assert_fails(["convert", "hf-to-mcore", str(tmp_path / "nope"), str(tmp_path / "out")], capsys, "does not exist")
    (tmp_path / "hf").mkdir()
    assert_fails(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "out")], capsys, "config.json is missing")
    (tmp_path / "hf" / "config.json").write_text("{not json")
    assert_fails(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "out")], capsys, "not readable JSON")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert_fails(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "out")], capsys,
                 "'bert' has no megatron-core adapter", "supported: llama, mistral, qwen2")
    assert no_partial_output(tmp_path)


def test_truncated_safetensors_is_named(tiny_checkpoints, tmp_path, capsys):
    source = tmp_path / "hf"
    shutil.copytree(tiny_checkpoints["llama"], source)
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_fails(["convert", "hf-to-mcore", str(source), str(tmp_path / "out")], capsys,
                 "model.safetensors is not a readable safetensors file", "truncated or corrupt")
    assert no_partial_output(tmp_path)


def test_missing_and_unexpected_tensors_listed_in_one_error(tiny_checkpoints, tmp_path, capsys):
    source = tmp_path / "hf"
    shutil.copytree(tiny_checkpoints["llama"], source)
    state = load_file(source / "model.safetensors")
    del state["model.layers.2.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)  # wrong shape: 2 KV heads x 8 = 16 rows
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    assert_fails(["convert", "hf-to-mcore", str(source), str(tmp_path / "out")], capsys, "3 problem(s)",
                 "'model.layers.2.mlp.up_proj.weight' is missing", "'model.layers.0.self_attn.q_norm.weight' is not used",
                 "model.layers.1.self_attn.k_proj.weight (8, 64) (expected (16, 64))")
    assert no_partial_output(tmp_path)


def test_existing_output_refused_unless_overwrite(tiny_checkpoints, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert_fails(["convert", "hf-to-mcore", str(tiny_checkpoints["llama"]), str(tmp_path / "out")], capsys,
                 "already exists", "--overwrite")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert dsmt(["convert", "hf-to-mcore", str(tiny_checkpoints["llama"]), str(tmp_path / "out"), "--overwrite"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "dsmt_checkpoint.json").is_file()


def test_foreign_or_newer_megatron_checkpoints_refused(tiny_checkpoints, tmp_path, capsys):
    foreign = tmp_path / "megatron-lm"
    foreign.mkdir()
    (foreign / "latest_checkpointed_iteration.txt").write_text("1000")
    assert_fails(["convert", "mcore-to-hf", str(foreign), str(tmp_path / "out")], capsys,
                 "was not written by `dsmt convert hf-to-mcore`", "Megatron-LM")
    mcore, _ = round_trip(tiny_checkpoints["llama"], tmp_path)
    metadata = json.loads((mcore / "dsmt_checkpoint.json").read_text())
    (mcore / "dsmt_checkpoint.json").write_text(json.dumps({**metadata, "format_version": 99}))
    assert_fails(["convert", "mcore-to-hf", str(mcore), str(tmp_path / "out")], capsys, "format_version 99")
    assert no_partial_output(tmp_path)


def test_non_default_vocab_padding_is_recorded_and_round_trips(tiny_checkpoints, tmp_path):
    mcore, back = round_trip(tiny_checkpoints["llama"], tmp_path, "--vocab-pad-multiple", "100")
    metadata = json.loads((mcore / "dsmt_checkpoint.json").read_text())
    assert (metadata["vocab_pad_multiple"], metadata["padded_vocab_size"]) == (100, 300)
    original, exported = hf_state(tiny_checkpoints["llama"]), hf_state(back)
    assert all(torch.equal(original[k], exported[k]) for k in original)
