"""Checkpoints as published: block-scaled FP8 (DeepSeek-V3) dequantised on read with --dequantize-fp8 or refused by
name, other quantisations refused by name, and passthrough tensors (multi-token-prediction layers the HF model does
not load) kept bit-exact through HF -> mcore -> HF and through training's export."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from toolkit.adapters import family as families
from toolkit.adapters.hf_source import QuantizedCheckpointError, SafetensorsSource, dequantize_fp8_blocks
from toolkit.cli import main as dsmt
from toolkit.models.tiny import make_tiny_checkpoint

BLOCK = (24, 40)  # rows x columns: not square, cut at every tiny weight's edges (64, 96, 16), QKV groups cross blocks
PASSTHROUGH = ("model.layers.2.*",)  # the tiny models have 2 layers: "layer 2" is the MTP layer
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hand_dequantize(weight, scale_inv, block):
    """The reference: element by element of each block, fp32 product, then bf16 (DeepSeek's fp8_cast_bf16.py)."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(-(-rows // block[0])):
        for j in range(-(-cols // block[1])):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[r, c] = weight[r, c].float() * scale_inv[i, j].item()
    return out.to(torch.bfloat16)


def quantize(weight, block):
    """(fp8 e4m3 weight, fp32 scale_inv [ceil(rows / br), ceil(cols / bc)]), one scale per block (amax / 448)."""
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32)
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = weight[r, c].abs().max().clamp(min=1e-12) / 448.0
            fp8[r, c] = (weight[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return fp8, scale


def read_all(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def assert_bit_exact(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.fixture
def passthrough_llama(monkeypatch):
    """The llama family keeping `model.layers.2.*` as passthrough (as deepseek_v3 keeps its MTP layer)."""
    llama = families.get_family("llama")
    monkeypatch.setitem(families._REGISTRY, "llama",
                        dataclasses.replace(llama, read_passthrough=lambda hf_config: PASSTHROUGH))


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    """(dir, expected export): a tiny 2-layer Llama stored as DeepSeek-V3 publishes: linear weights fp8 e4m3 with
    block scales, the rest bf16, an MTP-like layer 2 (one fp8 weight with scales, one bf16 norm)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "llama", num_hidden_layers=2)
    tensors, expected = read_all(path), {}
    for file in path.glob("*.safetensors"):
        file.unlink()
    torch.manual_seed(3)
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.layers.2.enorm.weight"] = 1 + 0.1 * torch.randn(64)
    stored = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and (name.split(".")[-2] in LINEAR or "eh_proj" in name):
            stored[name], stored[f"{name}_scale_inv"] = quantize(tensor, BLOCK)
            expected[name] = hand_dequantize(stored[name], stored[f"{name}_scale_inv"], BLOCK)
        else:
            stored[name] = expected[name] = tensor.to(torch.bfloat16)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path, expected


def test_dequantize_fp8_blocks_matches_a_hand_loop():
    torch.manual_seed(0)
    weight, scale = quantize(torch.randn(70, 100), BLOCK)  # 3 x 3 blocks, the last row and column cut
    full = dequantize_fp8_blocks(weight, scale, block_size=BLOCK)
    assert full.dtype == torch.bfloat16 and torch.equal(full, hand_dequantize(weight, scale, BLOCK))
    # a band of rows (a conversion chunk): rows 40..70 start 16 rows into block row 1 and end in block row 2
    band = dequantize_fp8_blocks(weight[40:70], scale[1:3], block_size=BLOCK, first_row=16)
    assert torch.equal(band, full[40:70])
    with pytest.raises(ValueError, match="does not cover"):
        dequantize_fp8_blocks(weight, scale[:2], block_size=BLOCK)


def test_fp8_checkpoint_dequantized_on_conversion_exports_bf16_bit_exact(fp8_llama, passthrough_llama, tmp_path):
    path, expected = fp8_llama
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert dsmt(["convert", "hf-to-mcore", str(path), str(mcore), "--dequantize-fp8", "--quiet"]) == 0
    assert (mcore / "hf_passthrough.safetensors").is_file()
    assert dsmt(["convert", "mcore-to-hf", str(mcore), str(back), "--quiet"]) == 0
    assert_bit_exact(read_all(back), expected)  # every weight, the MTP layer's included; no _scale_inv left
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


def test_fp8_checkpoint_refused_by_name_without_the_option(fp8_llama, tmp_path, capsys):
    from toolkit.convert.chunks import inspect_checkpoint

    path, _ = fp8_llama
    target = tmp_path / "mcore"
    assert dsmt(["convert", "hf-to-mcore", str(path), str(target), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "[fp8_checkpoint]" in err and f"dsmt convert hf-to-mcore {path} DST --dequantize-fp8" in err
    assert "'e4m3'" in err and "[24, 40]" in err
    assert not list(tmp_path.iterdir())  # no output, no partial directory
    assert dsmt(["verify", str(path)]) == 2  # refused before any rank starts
    assert "[fp8_checkpoint]" in capsys.readouterr().err
    with pytest.raises(QuantizedCheckpointError) as refused:  # training's and verify's loader
        inspect_checkpoint(path)
    assert refused.value.rule == "fp8_checkpoint"


@pytest.mark.parametrize("method", ["gptq", "bitsandbytes"])
def test_other_quantisations_refused_by_name(fp8_llama, tmp_path, capsys, method):
    path, _ = fp8_llama
    copy = tmp_path / "quantised"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (copy / "config.json").write_text(json.dumps(config))
    assert dsmt(["convert", "hf-to-mcore", str(copy), str(tmp_path / "out"), "--dequantize-fp8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "[quantized_checkpoint]" in err and repr(method) in err and "unquantised checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_fp8_weight_without_matching_scales_refused(fp8_llama, tmp_path):
    path, _ = fp8_llama
    copy = tmp_path / "broken"
    shutil.copytree(path, copy)
    tensors = read_all(copy)
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(QuantizedCheckpointError, match=r"2 FP8 tensor\(s\)") as refused:
        SafetensorsSource(copy, dequantize_fp8=True)
    assert refused.value.rule == "fp8_scales"
    assert "q_proj.weight [64, 64] has no" in str(refused.value) and "expected [1, 2]" in str(refused.value)


@pytest.fixture(scope="module")
def mtp_llama(tmp_path_factory):
    """A tiny sharded 2-layer Llama plus an MTP-like `model.layers.2.*` in a shard of its own (bf16, fp32, raw fp8,
    int64), listed in the index."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "llama", num_hidden_layers=2, max_shard_size="100KB")
    torch.manual_seed(5)
    extra = {"model.layers.2.extra.weight": torch.randn(5, 7).to(torch.bfloat16),
             "model.layers.2.self_attn.q_proj.weight": torch.randn(64, 64),
             "model.layers.2.eh_proj.weight": torch.randn(16, 8).to(torch.float8_e4m3fn),
             "model.layers.2.counter": torch.arange(3)}
    save_file(extra, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_passthrough_round_trip_bit_exact(mtp_llama, passthrough_llama, tmp_path):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert dsmt(["convert", "hf-to-mcore", str(mtp_llama), str(mcore), "--quiet"]) == 0
    assert sorted(read_all(mcore)) == sorted(n for n in read_all(mtp_llama) if n.startswith("model.layers.2."))
    assert dsmt(["convert", "mcore-to-hf", str(mcore), str(back), "--quiet", "--max-shard-gb", "0.0001"]) == 0
    assert_bit_exact(read_all(back), read_all(mtp_llama))
    index = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(read_all(mtp_llama))


def test_passthrough_tensors_neither_unexpected_nor_loaded(mtp_llama, passthrough_llama):
    from toolkit.adapters.load import check_hf_coverage, passthrough_names
    from toolkit.convert.chunks import inspect_checkpoint

    settings = inspect_checkpoint(mtp_llama).settings
    assert settings.passthrough_hf == PASSTHROUGH
    names = SafetensorsSource(mtp_llama).names()
    items = settings.load_items()
    assert check_hf_coverage(items=items, hf_names=names, ignored=settings.ignored_hf(), passthrough=PASSTHROUGH) == []
    unexpected = check_hf_coverage(items=items, hf_names=names, ignored=settings.ignored_hf())
    assert len(unexpected) == 4 and all("model.layers.2." in problem for problem in unexpected)
    kept = passthrough_names(patterns=PASSTHROUGH, names=names)
    assert not {n for item in items.values() for n in item.hf} & set(kept)
    assert passthrough_names(patterns=("model.layers.*.extra.weight",), names=names) == ["model.layers.2.extra.weight"]
    assert passthrough_names(patterns=("model.layers.2.*",), names=["model.layers.21.x", "model.layers.2"]) == []


def test_training_export_keeps_the_source_passthrough(mtp_llama, passthrough_llama, tmp_path):
    """What export_trained does around save_mcore_checkpoint (which writes no passthrough file): the source's
    tensors, from an HF directory or a dsmt megatron checkpoint, go into final-mcore and so into final-hf."""
    from toolkit.convert.passthrough import PASSTHROUGH_FILE, keep_source_passthrough, passthrough_notice

    mcore = tmp_path / "mcore"
    assert dsmt(["convert", "hf-to-mcore", str(mtp_llama), str(mcore), "--quiet"]) == 0
    for kind, source in (("hf", mtp_llama), ("mcore", mcore / "hf")):
        trained = tmp_path / f"final-mcore-{kind}"
        shutil.copytree(mcore, trained, ignore=shutil.ignore_patterns(PASSTHROUGH_FILE))
        assert keep_source_passthrough(kind=kind, hf_dir=source, patterns=PASSTHROUGH, mcore_dir=trained) == 4
        assert dsmt(["convert", "mcore-to-hf", str(trained), str(tmp_path / f"final-hf-{kind}"), "--quiet"]) == 0
        assert_bit_exact(read_all(tmp_path / f"final-hf-{kind}"), read_all(mtp_llama))
        notice = passthrough_notice(kind=kind, hf_dir=source, patterns=PASSTHROUGH)
        assert notice.startswith("dsmt train: 4 tensor(s) of model.layers.2.* are kept as published but not trained")
    assert passthrough_notice(kind="init", hf_dir=mtp_llama, patterns=PASSTHROUGH) is None
    assert passthrough_notice(kind="hf", hf_dir=mtp_llama, patterns=()) is None


def test_check_and_dry_run_name_an_fp8_checkpoint_with_its_fix(fp8_llama, tmp_path, capsys):
    """`dsmt check` (config.json only) and `dsmt train --dry-run` refuse it under the reader's own rule and fix."""
    import yaml

    path, _ = fp8_llama
    spec = {"model": {"path": str(path)},
            "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64, "precision": "fp32",
                         "train_steps": 5, "warmup_steps": 1, "checkpoint_interval": 5,
                         "output_dir": str(tmp_path / "out")},
            "data": {"synthetic": True}}
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    for argv in (["check", str(spec_path)], ["train", str(spec_path), "--dry-run"]):
        assert dsmt(argv) == 2
        out = "".join(capsys.readouterr())
        assert "fp8_checkpoint" in out and "--dequantize-fp8" in out, out
    assert not (tmp_path / "out").exists()
