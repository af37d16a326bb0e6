"""examples/resnet_images.py run as a user runs it: a tiny ResNet on a tiny image folder, 2 CPU ranks, ZeRO-1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
def test_resnet_images_example_trains_on_an_image_folder_and_exports(tmp_path):
    import numpy as np
    from PIL import Image
    from transformers import ResNetConfig, ResNetForImageClassification

    data = tmp_path / "images"
    rng = np.random.default_rng(1)
    for label, name in enumerate(("ant", "bee")):
        (data / name).mkdir(parents=True)
        for i in range(6):
            pixels = np.clip(rng.normal(60 + 120 * label, 30, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(data / name / f"{i}.png")
    model = tmp_path / "resnet"
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2, image_size=16)
    ResNetForImageClassification(config).save_pretrained(model)
    output = tmp_path / "run"
    result = subprocess.run([sys.executable, str(REPO / "examples" / "resnet_images.py"), "--data", str(data),
                             "--model", str(model), "--output", str(output), "--steps", "3"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 3 steps at DP2 ZeRO-1" in result.stdout
    assert "default image transform" in result.stdout and "bilinear resize to 16x16" in result.stdout
    assert ("model_type resnet has no megatron-core adapter: training with DeepSpeed ZeRO-1 data parallelism only"
            in result.stdout)
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss"] > 0 for m in metrics)
    exported = ResNetForImageClassification.from_pretrained(output / "final-hf")
    assert exported.config.num_labels == 2
