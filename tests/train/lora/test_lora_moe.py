"""LoRA on mixture-of-experts and multi-latent-attention families (issue 50), in one process: which modules take an
adapter and why the others do not, one rank's logits against peft's own model of the same adapter, the export's
fused-expert tensors against peft's file, and `dsmt check`'s refusals before any rank starts. The training runs
(TP2 x EP2, PP2 x EP2, against an HF + peft reference) are in test_train_lora.py's launch; EP2 -> EP4 resumes in
tests/train/checkpoint/test_train_reshard.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from toolkit.adapters.family import get_family
from toolkit.adapters.hf_config import model_settings
from toolkit.models.tiny import make_tiny_checkpoint, tiny_config
from toolkit.spec.schema import LoraSpec
from toolkit.train.lora.targets import LoraError, LoraFamilyError, resolve_targets

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "adapters"))  # one_process (tests/adapters)

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _peft_adapter(model_dir: Path, out_dir: Path, *, targets=None) -> Path:
    """peft's own adapter (rank 4, alpha 8) on the modules dsmt adapts for `targets`, B nonzero."""
    from train_helpers import write_peft_adapter

    return write_peft_adapter(model_dir, out_dir, rank=4, alpha=8.0, targets=targets, seed=3, b_scale=0.5)


def test_targets_name_what_peft_adapts_on_transformers_5():
    assert [m.name for m in resolve_targets(get_family("qwen3_moe"), None)] == [
        "q_proj", "k_proj", "v_proj", "o_proj"] + EXPERTS
    assert [m.name for m in resolve_targets(get_family("mixtral"), None)] == ["q_proj", "k_proj", "v_proj",
                                                                              "o_proj"] + EXPERTS
    mixtral = resolve_targets(get_family("mixtral"), ["experts.down_proj"])
    assert [(m.hf_path, m.linear, m.expert) for m in mixtral] == [
        ("model.layers.*.mlp.experts.down_proj", "mlp.experts.linear_fc2", True)]  # transformers 5's in-memory name


def test_targets_peft_would_misread_or_dsmt_does_not_adapt_are_refused_by_name():
    with pytest.raises(LoraError) as caught:
        resolve_targets(get_family("deepseek_v2"), ["q_proj", "gate_proj", "gate"])
    text = str(caught.value)
    assert "['gate_proj', 'gate'] match no deepseek_v2 module" in text
    assert "PEFT on transformers 5 reads these names of a deepseek_v2 model as its fused routed experts" in text
    assert "the router is named mlp.gate.weight" in text and "experts.gate_up_proj" in text
    with pytest.raises(LoraError, match=r"\['w1'\].*PEFT on transformers 5 reads these names of a mixtral"):
        resolve_targets(get_family("mixtral"), ["w1"])
    for model_type in ("gpt_oss", "llama4_text", "qwen3_next"):
        with pytest.raises(LoraFamilyError, match=f"training.lora on {model_type}: its routed experts take no LoRA"):
            resolve_targets(get_family(model_type), None)


def test_the_names_peft_redirects_are_read_from_peft_as_checked():
    """What dsmt withholds follows peft's conversion tables (peft pinned to 0.21 in pyproject.toml): if a peft
    release changes them (e.g. converts qwen2_moe too), this fails and the withheld targets need a new look."""
    from toolkit.adapters.peft_names import peft_redirected_names

    mlp, gate = {"gate_proj", "up_proj", "down_proj"}, {"gate"}
    for model_type in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next"):
        assert peft_redirected_names(model_type) == mlp | gate, model_type
    assert peft_redirected_names("mixtral") == {"w1", "w2", "w3"} | gate
    assert peft_redirected_names("qwen2_moe") == set() and peft_redirected_names("llama") == set()


def test_expert_adapters_refuse_dropout_as_peft_does():
    from toolkit.train.lora.apply import require_no_expert_dropout

    modules = resolve_targets(get_family("qwen3_moe"), None)
    with pytest.raises(LoraError, match="dropout=0.1 with the routed experts or the router targeted .*set "
                                        "training.lora.dropout: 0"):
        require_no_expert_dropout(modules, dropout=0.1)
    require_no_expert_dropout(resolve_targets(get_family("qwen3_moe"), ["q_proj"]), dropout=0.1)  # no experts: fine


ROUTER_TOO = ["q_proj", "o_proj", "mlp.gate.weight"] + EXPERTS


@pytest.mark.parametrize("model_type,targets", [("qwen3_moe", ROUTER_TOO), ("mixtral", None), ("deepseek_v3", None)])
def test_one_rank_logits_and_export_equal_peft(model_type, targets, tmp_path):
    """One rank (TP1, EP1): megatron with dsmt's adapters, started from peft's file (its fused experts split per
    expert), gives peft's logits; the adapter state it would export (joined back into peft's fused pairs) is
    peft's file bit for bit. Qwen3-MoE with its router adapted too (megatron's gating in fp32, PEFT's delta on the
    gate weight); DeepSeek-V3's tiny has the low-rank q (q_a_proj / q_b_proj: the down projection whole on every TP
    rank); Mixtral's checkpoint keeps per-expert w1 / w2 / w3 on disk."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from one_process import hf_model, megatron_model, one_process, rows
    from toolkit.train.lora.apply import apply_lora
    from toolkit.train.lora.export import join_experts, local_adapter_state

    model_dir = make_tiny_checkpoint(tmp_path / model_type, model_type=model_type, num_hidden_layers=2, seed=2)
    adapter = _peft_adapter(model_dir, tmp_path / "adapter", targets=targets)
    settings = model_settings(hf_model(model_dir).config)
    lora = LoraSpec(rank=4, alpha=8, init_adapter=str(adapter), targets=targets)
    tokens = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    with one_process():
        model = megatron_model(model_dir)
        apply_lora([model], settings=settings, lora=lora, seed=0)
        with torch.no_grad():
            ours = model(tokens, rows(tokens), None)[..., :250]
        state = join_experts(local_adapter_state([model]), settings=settings, rank=4,
                             modules=resolve_targets(settings.family, targets, rows=settings.rows))
    base = hf_model(model_dir)
    with torch.no_grad():
        plain = base(tokens).logits
        reference = PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
    saved = load_file(adapter / "adapter_model.safetensors")
    gap, effect = (ours - reference).abs().max().item(), (reference - plain).abs().max().item()
    print(f"\n{model_type}: |dsmt - peft| logits {gap:.2e} (the adapter moves them {effect:.2e})")
    assert gap <= 1e-5 and effect > 1e-2
    assert set(state) == set(saved) and any(".experts." in key for key in saved)
    assert all(torch.equal(state[key], saved[key]) for key in saved)


def _check_spec(tmp_path, *, model: dict, lora: dict) -> str:
    raw = {"model": model, "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
           "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32",
                        "warmup_steps": 1, "train_steps": 2, "lora": lora, "output_dir": str(tmp_path / "out")},
           "data": {"synthetic": True}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_check_refuses_rank_dropout_and_an_adapter_of_another_base(tmp_path):
    """`dsmt check` (no rank started): a rank above a targeted linear's smaller side, dropout with experts, and a
    PEFT adapter made for another base (its shapes, its base_model_name_or_path named)."""
    from toolkit.check.checks import check_file

    qwen = {"config": tiny_config("qwen3_moe").to_dict()}
    _, report = check_file(_check_spec(tmp_path, model=qwen, lora={"rank": 50, "dropout": 0.1,
                                                                        "targets": ["q_proj"] + EXPERTS}))
    text = report.to_text()
    assert {"lora_rank_too_large", "lora_expert_dropout"} <= report.rules("error"), text
    assert "rank=50 is larger than the smaller side of experts.down_proj [64 x 48]: the product" in text
    assert "set training.lora.rank to at most 48" in text
    model_dir = make_tiny_checkpoint(tmp_path / "mixtral", model_type="mixtral", num_hidden_layers=2, seed=1)
    other = make_tiny_checkpoint(tmp_path / "other", model_type="mixtral", num_hidden_layers=2, seed=1,
                                 intermediate_size=64)
    adapter = _peft_adapter(other, tmp_path / "adapter")
    _, report = check_file(_check_spec(tmp_path, model={"path": str(model_dir)},
                                       lora={"rank": 4, "alpha": 8.0, "init_adapter": str(adapter)}))
    text = report.to_text()
    assert "lora_init_adapter" in report.rules("error"), text
    assert "model.layers.0.mlp.experts.base_layer.lora_B.weight has shape (128, 16), expected (192, 16)" in text
    assert f"base_model_name_or_path: {other}" in text
    # the same shapes, made for another path (a copy): it fits, and the other base is named
    import shutil

    shutil.copytree(model_dir, tmp_path / "copy")
    same = _peft_adapter(tmp_path / "copy", tmp_path / "same")
    _, report = check_file(_check_spec(tmp_path, model={"path": str(model_dir)},
                                       lora={"rank": 4, "alpha": 8.0, "init_adapter": str(same)}))
    assert not report.rules("error") and "lora_init_adapter_base" in report.rules("warning"), report.to_text()
