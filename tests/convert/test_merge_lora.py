"""`dsmt convert merge-lora`: a PEFT adapter (linear modules, modules_to_save, fused experts through
target_parameters) merged into a tiny HF checkpoint gives PeftModel's logits; untouched tensors stay bit-equal;
a mismatched adapter is refused naming the key and both shapes, leaving no output behind."""

import json

import pytest
import torch
from safetensors import safe_open

from toolkit.cli import main as dsmt
from toolkit.convert.merge_lora import merge_lora
from toolkit.convert.peft_adapter import MergeLoraError, option_problems
from toolkit.models.tiny import make_tiny_checkpoint

LORA = dict(r=4, lora_alpha=8, init_lora_weights=False)
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def make_adapter(base, out, *, seed: int = 1, **lora_kwargs):
    """A PEFT adapter saved by PeftModel.save_pretrained, with random (not zero) B scaled to a small delta."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**{**LORA, **lora_kwargs}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
            elif "modules_to_save" in name:
                param.add_(0.01 * torch.randn_like(param))
    model.save_pretrained(out)
    return out


def logit_gaps(base, adapter, merged) -> tuple[float, float]:
    """(max |PeftModel - merged| logits, max |PeftModel - base| logits) on one fixed batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
    return (reference - merged).abs().max().item(), (reference - plain).abs().max().item()


def tensors(folder) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            found.update({name: handle.get_tensor(name) for name in handle.keys()})
    return found


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Tiny Llama saved in >= 2 safetensors shards."""
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("base") / "llama", max_shard_size="100KB")
    assert len(list(base.glob("model-*.safetensors"))) >= 2 and (base / "model.safetensors.index.json").is_file()
    return base


def test_llama_sharded_matches_peft(llama, tmp_path):
    adapter = make_adapter(llama, tmp_path / "adapter", target_modules=["q_proj", "v_proj", "down_proj"],
                           rank_pattern={"v_proj": 8}, alpha_pattern={"down_proj": 4}, modules_to_save=["lm_head"])
    summary = merge_lora(base_dir=llama, adapter_dir=adapter, out_dir=tmp_path / "merged")
    gap, effect = logit_gaps(llama, adapter, tmp_path / "merged")
    print(f"llama: merged vs PeftModel {gap:.2e}; adapter effect {effect:.2e}; {summary.line()}")
    assert gap <= 1e-5 and effect > 1e-3
    before, after = tensors(llama), tensors(tmp_path / "merged")
    num_layers = sum(name.endswith("q_proj.weight") for name in before)
    shards = len(list(llama.glob("model-*.safetensors")))
    assert (summary.tensors_merged, summary.tensors_replaced, summary.shards) == (3 * num_layers, 1, shards)
    assert sorted(before) == sorted(after)
    changed = {n for n in before if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight", "lm_head.weight"))}
    assert all(torch.equal(before[n], after[n]) for n in before if n not in changed)
    assert all(not torch.equal(before[n], after[n]) for n in changed)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (llama / name).read_bytes()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_fused_experts_match_peft(model_type, tmp_path):
    """target_parameters adapts transformers-5's fused experts; the checkpoint keeps them per expert on disk
    (qwen3_moe: mlp.experts.E.gate_proj / up_proj / down_proj; mixtral: block_sparse_moe.experts.E.w1 / w3 / w2)."""
    base = make_tiny_checkpoint(tmp_path / "base", model_type=model_type)
    # the router too (PEFT's target parameter mlp.gate.weight; Mixtral keeps it as block_sparse_moe.gate on disk),
    # with its own alpha, which PEFT keys by the parameter's name
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"],
                           target_parameters=EXPERTS + ["mlp.gate.weight"], alpha_pattern={"mlp.gate.weight": 64})
    summary = merge_lora(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    gap, effect = logit_gaps(base, adapter, tmp_path / "merged")
    print(f"{model_type}: merged vs PeftModel {gap:.2e}; adapter effect {effect:.2e}; {summary.line()}")
    assert gap <= 1e-5 and effect > 1e-3
    before, after = tensors(base), tensors(tmp_path / "merged")
    expert_names = [n for n in before if ".experts." in n or n.endswith(".gate.weight")]
    assert expert_names and all(not torch.equal(before[n], after[n]) for n in expert_names)
    assert summary.tensors_merged == len(expert_names) + sum(n.endswith("q_proj.weight") for n in before)


def test_bf16_base_is_merged_in_fp32_and_cast_once(llama, tmp_path):
    """Each merged bf16 tensor is exactly (fp32(W) + scaling * B @ A).to(bf16): no bf16 arithmetic on the way."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).save_pretrained(base)
    adapter = make_adapter(llama, tmp_path / "adapter", target_modules=["q_proj"])
    merge_lora(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "merged")
    before, after = tensors(base), tensors(tmp_path / "merged")
    lora = load_file(adapter / "adapter_model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    a, b = (lora[f"base_model.model.{name}.lora_{m}.weight"] for m in "AB")
    expected = (before[f"{name}.weight"].float() + (LORA["lora_alpha"] / LORA["r"]) * (b.float() @ a.float()))
    assert after[f"{name}.weight"].dtype == torch.bfloat16
    assert torch.equal(after[f"{name}.weight"], expected.to(torch.bfloat16))


def test_cli_merges_and_refuses_a_mismatched_adapter(llama, tmp_path, capsys):
    adapter = make_adapter(llama, tmp_path / "adapter", target_modules=["q_proj"])
    assert dsmt(["convert", "merge-lora", str(llama), str(adapter), str(tmp_path / "out"), "--quiet"]) == 0
    assert "tensors merged, 0 replaced" in capsys.readouterr().out
    assert dsmt(["convert", "merge-lora", str(llama), str(adapter), str(tmp_path / "out"), "--quiet"]) != 0
    assert "--overwrite" in capsys.readouterr().err

    other = make_tiny_checkpoint(tmp_path / "other", intermediate_size=80)
    wrong = make_adapter(other, tmp_path / "wrong", target_modules=["q_proj", "down_proj"])
    assert dsmt(["convert", "merge-lora", str(llama), str(wrong), str(tmp_path / "refused"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "base_model.model.model.layers.0.mlp.down_proj: lora_A [4, 80]" in err
    assert "model.layers.1.mlp.down_proj.weight [64, " in err and "q_proj" not in err
    assert "base_model_name_or_path" in err and str(other) in err
    assert not any(p.name.startswith((".refused", "refused")) for p in tmp_path.iterdir())


def test_refusals(llama, tmp_path):
    assert option_problems({"peft_type": "LORA", "bias": "none", "r": 4}) == []
    problems = option_problems({"peft_type": "LORA", "use_dora": True, "bias": "all", "lora_bias": True,
                                "init_lora_weights": "pissa"})
    assert [p.split("=")[0] for p in problems] == ["bias", "use_dora", "lora_bias", "init_lora_weights"]
    assert option_problems({"peft_type": "IA3"})[0].startswith("peft_type='IA3'")

    adapter = make_adapter(llama, tmp_path / "adapter", target_modules=["q_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(MergeLoraError, match="use_dora=True"):
        merge_lora(base_dir=llama, adapter_dir=adapter, out_dir=tmp_path / "out")
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(MergeLoraError, match="lacks adapter_model.safetensors"):
        merge_lora(base_dir=llama, adapter_dir=adapter, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_experts_of_a_family_without_peft_experts_are_refused(tmp_path):
    """A fused-experts adapter on a base whose model_type dsmt maps no experts for: refused by model type."""
    base = make_tiny_checkpoint(tmp_path / "base", model_type="qwen3_moe")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"], target_parameters=EXPERTS)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(MergeLoraError) as refused:
        merge_lora(base_dir=base, adapter_dir=adapter, out_dir=tmp_path / "out")
    assert "model.layers.0.mlp.experts has no base tensor" in str(refused.value)
    assert "qwen3_moe" in str(refused.value) and "'llama'" in str(refused.value)
