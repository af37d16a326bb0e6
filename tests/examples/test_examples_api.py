"""The Python-API examples run as a user runs them: `python examples/<script>.py ...` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_example(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_configs_writes_the_layouts_that_pass_and_names_the_rules_of_the_rest(tmp_path):
    out = tmp_path / "sweep"
    result = run_example("generate_configs.py", "--model", "llama3-70b", "--nodes", "4", "--tp", "2", "8",
                         "--pp", "1", "2", "--zero", "1", "3", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = dict(line.split("\t") for line in (out / "summary.tsv").read_text().splitlines())
    assert len(rows) == 8
    # 70B does not fit at TP2 with ZeRO-1 on 32 GPUs; ZeRO-3 with PP is refused by rule, not by memory
    assert "memory_fit" in rows["tp2-pp1-z1"] and "zero_with_pp" in rows["tp8-pp2-z3"]
    written = [label for label, status in rows.items() if status == "written"]
    assert "tp8-pp2-z1" in written
    for label in written:
        run_dir = out / label
        ds_config = json.loads((run_dir / "ds_config.json").read_text())
        assert ds_config["zero_optimization"]["stage"] == int(label[-1])
        assert (run_dir / "launch_deepspeed.sh").is_file() and (run_dir / "job.sbatch").is_file()
        megatron = json.loads((run_dir / "megatron.json").read_text())
        assert megatron["transformer_config"]["tensor_model_parallel_size"] == int(label.split("-")[0][2:])
    refused = [label for label, status in rows.items() if status != "written"]
    assert refused and not any((out / label).exists() for label in refused)  # nothing written for them


@pytest.mark.multiproc
def test_finetune_llama_trains_at_tp2_and_exports_an_hf_model(tmp_path):
    out = tmp_path / "ft"
    result = run_example("finetune_llama.py", "--output", str(out), "--steps", "4", "--tp", "2", "--lora-rank", "8")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 4 steps: loss" in result.stdout and "loads as LlamaForCausalLM" in result.stdout
    assert "final-hf-adapter loads with peft onto" in result.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, evaluations = [m for m in metrics if "loss" in m], [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and [m["step"] for m in evaluations] == [0, 4]
    assert evaluations[-1]["val_loss"] < evaluations[0]["val_loss"]
