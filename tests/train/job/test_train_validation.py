"""Validation loss during `dsmt train` (toolkit/train/job/evaluate.py): the same at the start whatever the layout
(TP×PP, interleaved PP with DP, DP at ZeRO-3; micro-batches of 2 and 1) and the packing of the rows, equal to a
one-process HF computation over the validation records, reported at step 0, every eval_interval and at the end,
and drawn in loss_curve.png.
All runs in ONE 4-rank gloo launch (train_helpers.train_in_one_launch)."""

import json
from pathlib import Path

import pytest
import torch

# The validation file: the first sentence of 40 stories (40-70 characters, one token each with the tiny
# tokenizer), short enough that packed rows hold two or three records (the packed runs have fewer rows).
NUM_VALIDATION = 40
SEQ = 128
STEPS = 3
EVAL_INTERVAL = 2
RUNS = {
    "tp2-pp2-micro2-unpacked": dict(tp=2, pp=2, dp=1, micro=2, packing=False),
    "pp2-vpp2-dp2-micro1-packed": dict(tp=1, pp=2, vpp=2, dp=2, micro=1, packing=True),
    "dp4-zero3-micro1-packed": dict(tp=1, pp=1, dp=4, zero=3, micro=1, packing=True),
}
# Measured (fp32, 2 CPU cores): see the report printed with `pytest -s`.
LAYOUT_TOLERANCE = 1e-5
REFERENCE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def launched(tiny_llama, tmp_path_factory) -> Path:
    from train_helpers import train_in_one_launch, write_spec

    root = tmp_path_factory.mktemp("validation-runs")
    validation_path = root / "validation.jsonl"
    validation_path.write_text("".join(json.dumps({"text": text}) + "\n" for text in validation_texts()))
    runs = {}
    for name, layout in RUNS.items():
        layout = dict(layout)
        extra = {"data": {"validation_path": str(validation_path), "packing": layout.pop("packing")},
                 "training": {"eval_interval": EVAL_INTERVAL}}
        runs[name] = write_spec(root / f"{name}.yaml", model_dir=tiny_llama, output_dir=root / name, seq=SEQ,
                                steps=STEPS, global_batch=4, extra=extra, **layout)
    # a run stopped after its checkpoint at step 2, then resumed to step 3 in the same output directory
    extra = {"data": {"validation_path": str(validation_path)}, "training": {"eval_interval": EVAL_INTERVAL}}
    for part, steps in (("resume-first", 2), ("resume-then", STEPS)):
        runs[part] = write_spec(root / f"{part}.yaml", model_dir=tiny_llama, output_dir=root / "resumed", seq=SEQ,
                                steps=steps, global_batch=4, dp=4, micro=1, checkpoint_interval=2, extra=extra)
    train_in_one_launch(runs=runs, root=root, nprocs=4)
    return root


def validation_texts() -> list[str]:
    from train_helpers import STORIES

    stories = [json.loads(line)["text"] for line in STORIES.read_text().splitlines() if line]
    return [story.split(". ")[0] + "." for story in stories[:NUM_VALIDATION]]


def text_pieces(tokenizer, texts: list[str], *, seq_length: int) -> list[list[int]]:
    """toolkit/data/tokenize.py's text rule, as its module docstring states it: each document tokenised as the
    tokenizer does by default, EOS appended (unless already last), a document longer than seq_length + 1 split
    into consecutive pieces of seq_length + 1, each its own document; a piece of one token has no label. Each
    document attends only to itself, so its loss is that of a forward of the piece alone, however rows pack it."""
    pieces = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        ids = ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]
        pieces += [ids[i:i + seq_length + 1] for i in range(0, len(ids), seq_length + 1)]
    return [piece for piece in pieces if len(piece) > 1]


def reference_val_loss(model_dir: Path) -> tuple[float, int]:
    """The per-token loss of the HF model over the validation records, one process: (loss, counted tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for piece in text_pieces(tokenizer, validation_texts(), seq_length=SEQ):
            ids = torch.tensor([piece])
            logits = model(ids).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            count += len(piece) - 1
    return (total / count).item(), count


@pytest.mark.multiproc
def test_a_resumed_run_keeps_its_validation_lines_and_does_not_repeat_them(launched):
    from train_helpers import read_metrics, read_validation

    assert [r["step"] for r in read_validation(launched / "resumed")] == [0, 2, 3]
    assert [r["step"] for r in read_metrics(launched / "resumed")] == [1, 2, 3]


def validation_rows(output_dir: Path) -> int:
    """Rows of the run's validation examples, from the data cache's metadata (toolkit/data/cache.py)."""
    metas = [json.loads(path.read_text()) for path in (output_dir / "data-cache").glob("*/meta.json")]
    (meta,) = [meta for meta in metas if meta["inputs"].get("part") == "validation"]
    return meta["num_examples"]


@pytest.mark.multiproc
def test_validation_loss_matches_across_layouts_and_the_reference(launched, tiny_llama):
    from train_helpers import read_metrics, read_validation

    reference, reference_tokens = reference_val_loss(tiny_llama)
    start = {}
    for name in RUNS:
        lines = read_validation(launched / name)
        assert [r["step"] for r in lines] == [0, 2, 3], (name, lines)
        assert {r["val_tokens"] for r in lines} == {reference_tokens}
        assert [r["step"] for r in read_metrics(launched / name)] == [1, 2, 3]  # training lines unchanged
        assert (launched / name / "loss_curve.png").stat().st_size > 0
        monitored = [path for path in (launched / name / "monitor").rglob("*") if "val_loss" in path.name]
        assert monitored and len(monitored[0].read_text().splitlines()) >= 3, (name, monitored)  # DeepSpeed CSV
        start[name] = lines[0]["val_loss"]
        assert lines[-1]["val_loss"] < lines[0]["val_loss"]  # it learns, on records it never trained on
    rows = {name: validation_rows(launched / name) for name in RUNS}
    assert rows["tp2-pp2-micro2-unpacked"] == NUM_VALIDATION
    assert rows["dp4-zero3-micro1-packed"] < NUM_VALIDATION  # packing is exercised
    spread = max(start.values()) - min(start.values())
    off = max(abs(value - reference) for value in start.values())
    print(f"\nstep-0 val_loss {start} over {reference_tokens} tokens in rows {rows}; reference {reference:.7f}; "
          f"spread across layouts {spread:.2e}; worst |dsmt - reference| {off:.2e}")
    assert spread <= LAYOUT_TOLERANCE
    assert off <= REFERENCE_TOLERANCE


# --- `dsmt check` and `dsmt train --dry-run` ---------------------------------------------------------------------

def _job(tmp_path, *, model_dir, data: dict) -> str:
    import yaml

    from train_helpers import STORIES, write_spec

    path = write_spec(tmp_path / "job.yaml", model_dir=model_dir, output_dir=tmp_path / "out", dp=1, micro=2,
                      global_batch=4, steps=2, extra={"data": {"path": str(STORIES), **data}})
    assert yaml.safe_load(path.read_text())["data"]["path"] == str(STORIES)
    return str(path)


def test_check_and_dry_run_name_a_missing_validation_file(tiny_llama, tmp_path, capsys):
    from toolkit.cli import main as dsmt

    job = _job(tmp_path, model_dir=tiny_llama, data={"validation_path": str(tmp_path / "val.jsonl")})
    assert dsmt(["check", job]) == 2
    assert "[validation_path_missing]" in capsys.readouterr().out
    assert dsmt(["train", job, "--dry-run"]) == 2
    text = capsys.readouterr().out
    assert "error   [validation_path_missing]" in text and "val.jsonl" in text and "text" in text


def test_dry_run_names_validation_fields_and_an_empty_side(tiny_llama, tmp_path, capsys):
    from toolkit.cli import main as dsmt

    other = tmp_path / "val.jsonl"
    other.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    job = _job(tmp_path, model_dir=tiny_llama, data={"validation_path": str(other)})
    assert dsmt(["train", job, "--dry-run"]) == 2
    text = capsys.readouterr().out
    assert "error   [validation_fields]" in text and "prompt, completion" in text and "reads text" in text
    job = _job(tmp_path, model_dir=tiny_llama, data={"validation_fraction": 0.001})  # 450 records: 0 held out
    assert dsmt(["train", job, "--dry-run"]) == 2
    assert "error   [validation_fraction_empty]" in capsys.readouterr().out
    job = _job(tmp_path, model_dir=tiny_llama, data={"validation_fraction": 0.1})
    assert dsmt(["train", job, "--dry-run"]) == 0
    assert "405 for training, 45 held out for validation" in capsys.readouterr().out


def test_a_trainer_without_evaluate_is_refused_by_name():
    from types import SimpleNamespace

    from toolkit.errors import DsmtError
    from toolkit.spec.schema import DataSpec
    from toolkit.train.job.evaluate import build_validation

    spec = SimpleNamespace(data=DataSpec(path="x.jsonl", validation_fraction=0.1))
    with pytest.raises(DsmtError, match="validation_unsupported: data.validation_fraction=0.1 .*SimpleNamespace"):
        build_validation(spec=spec, layout=None, trainer=SimpleNamespace(eval_step=None), hf_dir=None)


@pytest.mark.multiproc
def test_dsmt_train_exits_2_naming_validation_records_of_another_kind(tiny_llama, tmp_path):
    import subprocess
    import sys

    from train_helpers import REPO

    other = tmp_path / "val.jsonl"
    other.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    job = _job(tmp_path, model_dir=tiny_llama, data={"validation_path": str(other)})
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", "--config", job], capture_output=True,
                            text=True, cwd=REPO)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "[validation_fields] data.validation_path=" in result.stderr, result.stderr[-2000:]
    assert "nothing was started" in result.stderr and not (tmp_path / "out").exists(), result.stderr[-2000:]


def test_check_accepts_validation_for_a_model_without_an_adapter(tmp_path, capsys):
    """The plain engine evaluates too (PlainEngine.eval_step; tests/train/job/test_train_task_validation.py)."""
    from toolkit.cli import main as dsmt

    model_dir = tmp_path / "resnet"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "resnet",
                                                       "architectures": ["ResNetForImageClassification"]}))
    job = _job(tmp_path, model_dir=model_dir, data={"validation_fraction": 0.1})
    dsmt(["check", job])
    assert "validation_unsupported" not in capsys.readouterr().out
    job = _job(tmp_path, model_dir=model_dir, data={"validation_path": str(tmp_path / "missing")})
    assert dsmt(["check", job]) == 2
    assert "error   [validation_path_missing]" in capsys.readouterr().out
