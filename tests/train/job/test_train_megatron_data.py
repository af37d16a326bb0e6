"""`dsmt train` on a Megatron corpus written by `dsmt data prepare` (data.format: megatron): TP2 x PP2 and DP4 give
the same losses, and the first step's loss is that of the HF model over the samples megatron-core's own GPTDataset
draws (built here with megatron-core's API from its documented settings), one forward per document: the
positions restart after each EOD and the label read at an EOD does not count.
Both runs in ONE 4-rank gloo launch (train_helpers.train_in_one_launch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import STORIES, read_metrics, read_validation, train_in_one_launch, write_spec

from toolkit.cli import main as dsmt

SEQ, GLOBAL_BATCH, STEPS, SEED = 32, 8, 3, 7  # SEED: train_helpers.write_spec's training.seed
EOD = 2  # the tiny tokenizer's </s>
RUNS = {"tp2-pp2": dict(tp=2, pp=2, dp=1), "dp4": dict(tp=1, pp=1, dp=4)}
TOLERANCE = 1e-5  # fp32; measured differences are printed with `pytest -s`


@pytest.fixture(scope="module")
def launched(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("megatron-data")
    prefix = root / "stories"
    assert dsmt(["data", "prepare", str(STORIES), "--tokenizer", str(tiny_llama), "--output", str(prefix),
                 "--workers", "2"]) == 0
    runs = {}
    for name, layout in RUNS.items():
        runs[name] = write_spec(root / f"{name}.yaml", model_dir=tiny_llama, output_dir=root / name, micro=2,
                                global_batch=GLOBAL_BATCH, steps=STEPS, seq=SEQ, **layout,
                                extra={"data": {"format": "megatron", "path": str(prefix),
                                                "validation_fraction": 0.1}})
    train_in_one_launch(runs=runs, root=root, nprocs=4)
    return root, prefix


class _Eod:
    """What megatron-core's GPTDataset reads of a tokenizer."""

    eod, vocab_size = EOD, 250
    unique_identifiers = {"class": "test-reference"}


def megatron_samples(prefix: Path, cache: Path, count: int) -> list[dict]:
    """Samples 0 .. count-1 of the training split, from megatron-core's builder with the settings dsmt documents
    (toolkit/data/indexed.py): seed, seq_length, split (1-f),f,0, reset positions, EOD loss mask."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=([str(prefix)], None), split="0.9,0.1,0",
                              path_to_cache=str(cache), tokenizer=_Eod(), reset_position_ids=True,
                              reset_attention_mask=False, eod_mask_loss=True, create_attention_mask=False)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [STEPS * GLOBAL_BATCH, 0, 0], lambda: True, config).build()[0]
    return [train[i] for i in range(count)]


def hf_loss(model_dir: Path, samples: list[dict]) -> float:
    """Per-token loss over the samples: a forward per document (cut where the positions restart)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, counted = 0.0, 0.0
    with torch.no_grad():
        for sample in samples:
            starts = [t for t, p in enumerate(sample["position_ids"].tolist()) if p == 0] + [SEQ]
            for start, end in zip(starts, starts[1:]):
                logits = model(input_ids=sample["tokens"][None, start:end]).logits.float()[0]
                losses = torch.nn.functional.cross_entropy(logits, sample["labels"][start:end], reduction="none")
                total += float((losses * sample["loss_mask"][start:end]).sum())
                counted += float(sample["loss_mask"][start:end].sum())
    return total / counted


@pytest.mark.multiproc
def test_layouts_agree_and_match_hf_on_megatron_samples(launched, tiny_llama):
    root, prefix = launched
    losses = {name: [line["loss"] for line in read_metrics(root / name)] for name in RUNS}
    assert len(losses["tp2-pp2"]) == STEPS
    layout_gap = max(abs(a - b) for a, b in zip(losses["tp2-pp2"], losses["dp4"]))
    val = {name: [line["val_loss"] for line in read_validation(root / name)] for name in RUNS}
    val_gap = max(abs(a - b) for a, b in zip(val["tp2-pp2"], val["dp4"]))
    samples = megatron_samples(prefix, root / "reference-cache", GLOBAL_BATCH)
    assert any((s["tokens"] == EOD).any() for s in samples)  # the batch holds document boundaries
    reference_gap = abs(losses["tp2-pp2"][0] - hf_loss(tiny_llama, samples))
    print(f"megatron corpus: layout gap {layout_gap:.2e}, validation gap {val_gap:.2e}, vs HF {reference_gap:.2e}")
    assert layout_gap < TOLERANCE and val_gap < TOLERANCE and len(val["dp4"]) >= 2
    assert reference_gap < TOLERANCE
