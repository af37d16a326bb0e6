"""examples/bert_regression.py run as a user runs it: a tiny random BERT regression model (--make-tiny) on the tiny
scores data, TP2 x DP2 on 4 CPU ranks, exported and reloaded with AutoModelForSequenceClassification."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
def test_bert_regression_example_trains_at_tp2_dp2_and_exports(tmp_path):
    from transformers import AutoModelForSequenceClassification

    model, output = tmp_path / "bert-reg", tmp_path / "run"
    result = subprocess.run([sys.executable, str(REPO / "examples" / "bert_regression.py"), "--make-tiny",
                             "--model", str(model), "--output", str(output), "--steps", "4", "--lr", "1e-3"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--make-tiny: a tiny random BERT regression model" in result.stdout
    assert "trained 4 steps at TP2 x DP2 ZeRO-1: MSE" in result.stdout
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(m["loss"] > 0 for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    exported = AutoModelForSequenceClassification.from_pretrained(output / "final-hf")
    assert exported.config.num_labels == 1 and type(exported).__name__ == "BertForSequenceClassification"


def test_bert_regression_spec_is_tp2_dp2_regression_on_the_label_field(tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import bert_regression
    finally:
        sys.path.pop(0)
    args = bert_regression.parse_args(["--model", str(tmp_path / "m"), "--output", str(tmp_path / "o")])
    spec = bert_regression.build_spec(args)
    assert (spec["parallel"]["tp"], spec["cluster"]["gpus_per_node"]) == (2, 4)
    assert spec["training"]["global_batch_size"] == args.micro_batch * args.grad_accum * 2
    assert spec["data"]["label_field"] == "label" and Path(spec["data"]["path"]).is_file()
