"""`dsmt train --dry-run` reads training.lora.init_adapter as the ranks will: a PEFT adapter of another rank or
other targets is an error before anything launches; a fitting one is reported."""

from __future__ import annotations

import yaml

from toolkit.models.tiny import make_tiny_checkpoint
from toolkit.check.dryrun import dry_run


def _peft_adapter(model_dir, out_dir, *, rank: int, targets: list[str]):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    model.save_pretrained(out_dir)
    return out_dir


def _spec(tmp_path, *, model_dir, lora: dict) -> str:
    raw = {"model": {"path": str(model_dir)},
           "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
           "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32",
                        "warmup_steps": 1, "train_steps": 2, "checkpoint_interval": 2, "lora": lora,
                        "output_dir": str(tmp_path / "out")},
           "data": {"synthetic": True}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_dry_run_compares_the_init_adapter_with_the_run(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    adapter = _peft_adapter(model_dir, tmp_path / "adapter", rank=4, targets=["q_proj", "v_proj"])
    fits = dry_run(_spec(tmp_path, model_dir=model_dir, lora={"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"],
                                                              "init_adapter": str(adapter)}))
    assert fits.ok and "lora_init_adapter" in fits.rules("info"), fits.to_text()
    wrong = dry_run(_spec(tmp_path, model_dir=model_dir, lora={"rank": 8, "alpha": 8.0, "init_adapter": str(adapter)}))
    assert "lora_init_adapter" in wrong.rules("error"), wrong.to_text()
    text = wrong.to_text()
    assert "r=4 in the adapter, training.lora.rank=8" in text and "target_modules=" in text
