"""Conversion both ways in this process: bit-exact round trips and every bad input named, nothing half-written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.cli import main as dsmt
from tests.adapters.conftest import VARIANTS
from toolkit.models.tiny import make_tiny_checkpoint
from toolkit.adapters.family import supported_model_types


def hf_state(directory):
    state = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def round_trip(source, tmp_path, *extra):
    assert dsmt(["convert", "hf-to-mcore", str(source), str(tmp_path / "mcore"), *extra]) == 0
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    return tmp_path / "mcore", tmp_path / "back"


@pytest.mark.parametrize("variant", ["llama", "llama_tied", "qwen2", "qwen2_tied", "mistral", "qwen3", "gemma", "phi3",
                                     "gpt2", "phi3_longrope", "granite", "starcoder2", "olmo2", "gemma2", "gemma3",
                                     "seed_oss", "smollm3", "ernie4_5", "olmo3", "exaone4", "phi4_mini"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(variant, tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    mcore, back = round_trip(tiny_checkpoints[variant], tmp_path)
    original, exported = hf_state(tiny_checkpoints[variant]), hf_state(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) and original[k].dtype == exported[k].dtype for k in original)
    assert json.loads((mcore / "dsmt_checkpoint.json").read_text())["padded_vocab_size"] == 256
    assert (back / "tokenizer.json").is_file() and (mcore / "hf" / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.config.model_type == VARIANTS[variant]["model_type"]


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


@pytest.mark.parametrize("model_type", ["granite", "starcoder2", "olmo2", "gemma2", "gemma3_text", "seed_oss", "smollm3",
                                        "ernie4_5", "olmo3", "exaone4", "gpt_oss", "qwen3_next", "llama4_text"])
def test_bf16_round_trip_of_the_newer_families_is_bit_exact(model_type, tmp_path):
    source = make_tiny_checkpoint(tmp_path / "hf", model_type=model_type, dtype=torch.bfloat16)
    mcore, back = round_trip(source, tmp_path)
    assert json.loads((mcore / "dsmt_checkpoint.json").read_text())["params_dtype"] == "bfloat16"
    original, exported = hf_state(source), hf_state(back)
    assert sorted(original) == sorted(exported)
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(original[k], exported[k]) for k in original)


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
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert_fails(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "out")], capsys,
                 "'t5' has no megatron-core adapter", "supported: " + ", ".join(supported_model_types()))
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


def test_export_streams_tensor_by_tensor_without_a_model(tiny_checkpoints, tmp_path, monkeypatch):
    """mcore-to-hf reads the torch_dist files block of rows by block of rows, straight into the HF tensor being
    made: no model is built, no process group started, no stored chunk loaded whole through torch, and no read
    is larger than the largest HF tensor."""
    import torch.distributed as dist

    from toolkit.convert.mcore_reader import McoreReader

    assert dsmt(["convert", "hf-to-mcore", str(tiny_checkpoints["qwen2"]), str(tmp_path / "mcore")]) == 0
    monkeypatch.setattr("toolkit.adapters.build.build_model_chunks", lambda **_: pytest.fail("built a model"))
    monkeypatch.setattr(McoreReader, "_load_chunk", lambda *_: pytest.fail("loaded a whole chunk"))
    largest, read_rows = [0], McoreReader.read_rows

    def tracked_read_rows(reader, name, *, start, into):
        largest[0] = max(largest[0], into.numel())
        return read_rows(reader, name, start=start, into=into)

    monkeypatch.setattr(McoreReader, "read_rows", tracked_read_rows)
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    assert not dist.is_initialized()
    original, exported = hf_state(tiny_checkpoints["qwen2"]), hf_state(tmp_path / "back")
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert largest[0] == max(t.numel() for t in original.values())  # the embedding's 250 rows, not the padded 256


def test_checkpoint_tensors_missing_from_the_table_are_named(tiny_checkpoints, tmp_path, capsys):
    """A megatron checkpoint of another shape (here: fewer layers than its config says) fails before writing."""
    assert dsmt(["convert", "hf-to-mcore", str(tiny_checkpoints["llama"]), str(tmp_path / "mcore")]) == 0
    config = json.loads((tmp_path / "mcore" / "hf" / "config.json").read_text())
    (tmp_path / "mcore" / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    assert_fails(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "out")], capsys,
                 "weight table row 'decoder.layers.5.self_attention.linear_qkv.weight' has no tensor",
                 "stacks 4 layers, the config has 6")
    assert no_partial_output(tmp_path)


def test_rank0_task_status_done_failed_and_dead(tmp_path):
    """The ranks that wait for rank 0's export: done returns rank 0's result, a failure on rank 0 raises on the waiter with rank
    0's error, a rank 0 that stops beating is reported after the stale time, another run's file is ignored."""
    import threading

    from toolkit.launch.rank0 import RankTaskError, lead_task, wait_for_task

    status = tmp_path / "status.json"

    def lead_in_thread(task, token):
        def run():
            try:
                lead_task(task, status_file=status, token=token, heartbeat_s=0.05)
            except RuntimeError:
                pass
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def slow_ok(progress):
        for i in range(5):
            progress(f"tensor {i}")
            __import__("time").sleep(0.1)
        return {"shards": 2}

    thread = lead_in_thread(slow_ok, "run-1")
    result = wait_for_task(status_file=status, token="run-1", what="export", stale_after_s=2, poll_s=0.01)
    thread.join()
    assert result == {"shards": 2}  # what rank 0's task returned reaches the waiting ranks
    assert json.loads(status.read_text())["state"] == "done"

    def fails(progress):
        progress("halfway")
        raise RuntimeError("disk full")

    thread = lead_in_thread(fails, "run-2")
    with pytest.raises(RankTaskError, match="export failed on rank 0: RuntimeError: disk full"):
        wait_for_task(status_file=status, token="run-2", what="export", stale_after_s=2, poll_s=0.01)
    thread.join()
    # "run-2" failed and "run-1" was done: a waiter for "run-3" takes neither, and gives up when nothing beats.
    with pytest.raises(RankTaskError, match="has not updated .* for 0 s .it never started"):
        wait_for_task(status_file=status, token="run-3", what="export", stale_after_s=0.3, poll_s=0.01)
