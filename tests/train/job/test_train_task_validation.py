"""Validation loss of the encoder heads (BERT through the hybrid engine) and of the plain engine (HF models without
an adapter), toolkit/train/job/evaluate.py `TaskValidation`:

  * BERT masked LM at TP2 x DP2 and PP2 x DP2 on a validation file of 11 stories: the same step-0 val_loss, equal
    to a one-process HF computation written here (its own tokenisation and masking, following the rules of
    toolkit/data/tasks.py: validation row v masked from `torch.Generator().manual_seed(seed * 2**32 + v)`);
  * BERT regression at PP2 x DP2 on a held-out 5 % of tiny_scores (data.validation_fraction): per-sample squared
    error, equal to the one-process HF value over the held-out records (toolkit/data/validation.py's split rule);
  * a plain DistilBERT masked LM at DP4 (ZeRO-1) on a validation file, equal to the same one-process computation;
  * a plain ResNet at DP4 under ZeRO-3 on 24 images, a quarter held out (DeepSpeed's forward gathers the weights).
Every run reports validation at step 0, every eval_interval (2) and at the end (3); the row counts leave padding
rows on some ranks (they must add nothing). All runs in ONE 4-rank gloo launch (train_helpers.train_in_one_launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCORES = REPO / "examples" / "data" / "tiny_scores.jsonl"
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"
SEQ, PLAIN_SEQ, STEPS, EVAL_INTERVAL, SEED = 64, 32, 3, 2, 7  # SEED: train_helpers.write_spec's training.seed
NUM_MLM_VALIDATION, NUM_PLAIN_VALIDATION = 11, 9  # odd: the short ranks get padding rows
SCORES_FRACTION, IMAGES_FRACTION = 0.05, 0.25
MLM_PROBABILITY, MASK_REPLACE, RANDOM_OF_REST = 0.15, 0.8, 0.5  # BERT's 80 / 10 / 10
RUNS = {
    "bert-mlm-tp2-dp2": dict(model="mlm", tp=2, pp=1, dp=2),
    "bert-mlm-pp2-dp2": dict(model="mlm", tp=1, pp=2, dp=2),
    "bert-regression-pp2-dp2": dict(model="regression", tp=1, pp=2, dp=2),
    "plain-mlm-dp4": dict(model="plain-mlm", dp=4),
    "plain-images-dp4-zero3": dict(model="plain-images", dp=4, zero=3),
}
# Measured (fp32, 2 CPU cores; `pytest -s` prints them): |dsmt - reference| BERT MLM TP2 1.3e-7, PP2 2.2e-7,
# regression 1.1e-8, plain DistilBERT 1.4e-7; MLM TP2 vs PP2 8.9e-8. The launch takes ~85 s.
LAYOUT_TOLERANCE = 1e-5
REFERENCE_TOLERANCE = 1e-5


def story_texts() -> list[str]:
    return [json.loads(line)["text"] for line in STORIES.read_text().splitlines() if line]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import ResNetConfig, ResNetForImageClassification

    from plain_helpers import distilbert
    from toolkit.demo.tiny_encoder import make_tiny_bert

    root = tmp_path_factory.mktemp("validation-models")
    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                              layer_type="basic", num_labels=3, image_size=32)
                                 ).save_pretrained(root / "images")
    return {"mlm": make_tiny_bert(root / "mlm", architecture="BertForMaskedLM", seed=4),
            "regression": make_tiny_bert(root / "regression", architecture="BertForSequenceClassification",
                                         num_labels=1, seed=3),
            "plain-mlm": distilbert(root / "plain-mlm", head="MaskedLM"), "plain-images": root / "images"}


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory) -> Path:
    from plain_helpers import write_image_folder, write_text
    from train_helpers import train_in_one_launch, write_spec

    root = tmp_path_factory.mktemp("validation-task-runs")
    stories = story_texts()
    data = {
        "mlm": {"path": str(STORIES), "validation_path": str(write_jsonl(
            root / "stories-validation.jsonl", [{"text": t} for t in stories[-NUM_MLM_VALIDATION:]]))},
        "regression": {"path": str(SCORES), "label_field": "label", "validation_fraction": SCORES_FRACTION},
        "plain-mlm": {"path": str(write_text(root / "plain-train.jsonl")),
                      "validation_path": str(write_text(root / "plain-validation.jsonl",
                                                        count=NUM_PLAIN_VALIDATION))},
        "plain-images": {"path": str(write_image_folder(root / "images")), "label_field": "label",
                         "validation_fraction": IMAGES_FRACTION},
    }
    runs = {}
    for name, run in RUNS.items():
        run = dict(run)
        model = run.pop("model")
        plain = model.startswith("plain")
        runs[name] = write_spec(root / f"{name}.yaml", model_dir=models[model], output_dir=root / name,
                                seq=PLAIN_SEQ if plain else SEQ, steps=STEPS, micro=2, global_batch=8,
                                extra={"data": {**data[model], "shuffle": True},
                                       "training": {"eval_interval": EVAL_INTERVAL}}, **run)
    train_in_one_launch(runs=runs, root=root, nprocs=4)
    return root


def reference_mask(ids: list[int], *, row: int, length: int, vocab_len: int,
                   mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input ids, labels with -100) of validation row `row`, whose unpadded token ids are `ids`
    ([CLS] ... [SEP]). The draws are over the row padded to `length` (seq_length) tokens, in HF's collator order:
    which tokens (15 %, never [CLS], [SEP] or padding), which of those become [MASK] (80 %), which of the rest a
    random id (half), the random ids."""
    generator = torch.Generator().manual_seed(SEED * 2**32 + row)
    real = len(ids)
    probability = torch.full((1, length), MLM_PROBABILITY)
    probability[0, 0] = probability[0, real - 1] = 0.0
    probability[0, real:] = 0.0
    masked = torch.bernoulli(probability, generator=generator).bool()[0]
    replaced = torch.bernoulli(torch.full((1, length), MASK_REPLACE), generator=generator).bool()[0] & masked
    randomised = (torch.bernoulli(torch.full((1, length), RANDOM_OF_REST), generator=generator).bool()[0]
                  & masked & ~replaced)
    random_ids = torch.randint(vocab_len, (1, length), generator=generator)[0]
    inputs = torch.tensor(ids + [0] * (length - real))
    labels = torch.where(masked, inputs, torch.full_like(inputs, -100))
    inputs = torch.where(replaced, torch.full_like(inputs, mask_id), inputs)
    inputs = torch.where(randomised, random_ids, inputs)
    return inputs[:real], labels[:real]


def reference_mlm_loss(model_dir: Path, texts: list[str], *, seq_length: int) -> tuple[float, int]:
    """Per masked token over the validation texts, one process, each text alone (no padding): (loss, tokens)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForMaskedLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row, text in enumerate(texts):
            ids = tokenizer(text, truncation=True, max_length=seq_length)["input_ids"]
            inputs, labels = reference_mask(ids, row=row, length=seq_length, vocab_len=len(tokenizer),
                                            mask_id=tokenizer.convert_tokens_to_ids("[MASK]"))
            logits = model(input_ids=inputs[None]).logits[0].double()
            total += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
    return (total / count).item(), count


def reference_regression_loss(model_dir: Path) -> tuple[float, int]:
    """Squared error per held-out record: `round(N * f)` records, the first entries of randperm(N) seeded with
    training.seed, in record order."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    records = [json.loads(line) for line in SCORES.read_text().splitlines() if line]
    held_out = round(len(records) * SCORES_FRACTION)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(SEED))[:held_out]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for index in sorted(order.tolist()):
            encoded = tokenizer(records[index]["text"], truncation=True, max_length=SEQ, return_tensors="pt")
            total += (model(**encoded).logits[0, 0].double() - records[index]["label"]) ** 2
    return (total / held_out).item(), held_out


@pytest.mark.multiproc
def test_encoder_and_plain_validation_losses_match_the_reference_at_every_layout(launched, models):
    from train_helpers import read_metrics, read_validation

    lines = {name: read_validation(launched / name) for name in RUNS}
    for name, found in lines.items():
        assert [r["step"] for r in found] == [0, EVAL_INTERVAL, STEPS], (name, found)
        assert [r["step"] for r in read_metrics(launched / name)] == [1, 2, 3]  # training lines unchanged
        assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in found)
    stories = story_texts()[-NUM_MLM_VALIDATION:]
    mlm, mlm_tokens = reference_mlm_loss(models["mlm"], stories, seq_length=SEQ)
    regression, records = reference_regression_loss(models["regression"])
    plain_texts = [json.loads(line)["text"] for line in
                   (launched / "plain-validation.jsonl").read_text().splitlines() if line]
    plain, plain_tokens = reference_mlm_loss(models["plain-mlm"], plain_texts, seq_length=PLAIN_SEQ)
    expected = {"bert-mlm-tp2-dp2": (mlm, mlm_tokens), "bert-mlm-pp2-dp2": (mlm, mlm_tokens),
                "bert-regression-pp2-dp2": (regression, records), "plain-mlm-dp4": (plain, plain_tokens)}
    start = {name: lines[name][0]["val_loss"] for name in RUNS}
    off = {name: abs(start[name] - value) for name, (value, _) in expected.items()}
    spread = abs(start["bert-mlm-tp2-dp2"] - start["bert-mlm-pp2-dp2"])
    print(f"\nstep-0 val_loss {start}\nreference {expected}\n|dsmt - reference| "
          + ", ".join(f"{name} {value:.2e}" for name, value in off.items()) + f"; MLM TP2 vs PP2 spread {spread:.2e}")
    for name, (_, units) in expected.items():
        assert {r["val_tokens"] for r in lines[name]} == {units}, (name, lines[name])
    assert spread <= LAYOUT_TOLERANCE
    assert max(off.values()) <= REFERENCE_TOLERANCE
    assert {r["val_tokens"] for r in lines["plain-images-dp4-zero3"]} == {round(24 * IMAGES_FRACTION)}
    for name in ("bert-regression-pp2-dp2", "plain-images-dp4-zero3"):  # the weights moved between evaluations
        assert len({r["val_loss"] for r in lines[name]}) == 3, lines[name]


# --- `dsmt check` and `dsmt train --dry-run` build the validation examples as the ranks do -----------------------

def test_dry_run_reports_the_encoder_and_plain_validation_examples(models, tmp_path, capsys):
    from plain_helpers import write_image_folder
    from toolkit.cli import main as dsmt
    from train_helpers import write_spec

    validation = write_jsonl(tmp_path / "v.jsonl", [{"text": t} for t in story_texts()[-NUM_MLM_VALIDATION:]])
    cases = {
        "mlm": ({"path": str(STORIES), "validation_path": str(validation)},
                f"data.validation_path={validation}: {NUM_MLM_VALIDATION} validation examples for masked_lm"),
        "regression": ({"path": str(SCORES), "label_field": "label", "validation_fraction": SCORES_FRACTION},
                       "10 validation examples for sequence_classification"),
        "plain-images": ({"path": str(write_image_folder(tmp_path / "images")), "label_field": "label",
                          "validation_fraction": IMAGES_FRACTION}, "6 validation examples for image_classification"),
    }
    for model, (data, expected) in cases.items():
        job = write_spec(tmp_path / f"{model}.yaml", model_dir=models[model], output_dir=tmp_path / model, dp=1,
                         micro=2, global_batch=4, steps=2, seq=PLAIN_SEQ, extra={"data": data})
        assert dsmt(["check", str(job)]) in (0, 1), model
        assert dsmt(["train", str(job), "--dry-run"]) == 0, (model, capsys.readouterr().out[-3000:])
        text = capsys.readouterr().out
        assert "validation_unsupported" not in text and expected in text, (model, text[-3000:])
    # validation records of another kind: named, as training would fail on them
    job = write_spec(tmp_path / "bad.yaml", model_dir=models["regression"], output_dir=tmp_path / "bad", dp=1,
                     micro=2, global_batch=4, steps=2, seq=PLAIN_SEQ,
                     extra={"data": {"path": str(SCORES), "label_field": "label", "validation_path": str(validation)}})
    assert dsmt(["train", str(job), "--dry-run"]) == 2
    text = capsys.readouterr().out
    assert "error   [label_field]" in text and f"data.validation_path={validation}" in text, text[-3000:]
