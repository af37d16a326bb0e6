"""`toolkit.api.initialize`: a user's own loop over HF-convention micro-batches, at three layouts of the same
global batch (tp1 pp1; tp2 pp2; dp2 ZeRO-2), against plain transformers; bad micro-batches named on every rank.

The rows are tokenised here (the tiny model's tokenizer, one story per row, right-padded, labels -100 on the
padding) and handed to every launch as tensors, so every layout trains on the very same global batches; the
reference is HF's own loss of the same rows (`model(input_ids, attention_mask=..., labels=...)`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

STORIES = Path(__file__).resolve().parents[3] / "examples" / "data" / "tiny_stories.jsonl"
STEPS, SAVE_AT = 4, 2
SEQ, MICRO, GLOBAL = 32, 2, 8
EVAL_ROWS = 13  # dp2 ranks hold 7 and 6 rows: 4 and 3 micro-batches, the short rank padded by dsmt
BAD_CASES = ("shape", "dtype", "vocab", "count", "raises", "replica")


def spec_for(model_dir: Path, output_dir: Path, *, tp: int, pp: int, dp: int, zero: int) -> dict:
    """No `data` section: the script brings its batches."""
    return {"model": {"path": str(model_dir)},
            "cluster": {"nodes": 1, "gpus_per_node": tp * pp * dp, "gpu": "cpu", "device": "cpu",
                        "interconnect": "tcp"},
            "parallel": {"tp": tp, "pp": pp, "zero_stage": zero},
            "training": {"global_batch_size": GLOBAL, "micro_batch_size": MICRO, "seq_length": SEQ,
                         "precision": "fp32", "lr": 2e-3, "min_lr": 2e-3, "lr_schedule": "constant",
                         "warmup_steps": 0, "weight_decay": 0.1, "grad_clip": 0.5, "train_steps": 10, "seed": 7,
                         "output_dir": str(output_dir)}}


def tokenised_rows(model_dir: Path, *, count: int) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = [json.loads(line)["text"] for line in STORIES.read_text().splitlines()[:count]]
    ids = [(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])[:SEQ] for text in records]
    input_ids = torch.full((count, SEQ), tokenizer.pad_token_id or 0, dtype=torch.long)
    attention_mask = torch.zeros((count, SEQ), dtype=torch.long)
    for row, tokens in enumerate(ids):
        input_ids[row, :len(tokens)], attention_mask[row, :len(tokens)] = torch.tensor(tokens), 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


@pytest.fixture(scope="module")
def script_runs(tiny_llama, tmp_path_factory):
    """Three launches: tp1 pp1 (1 rank), tp2 pp2 (4 ranks: checkpoint at step 2, export, bad micro-batches), dp2
    ZeRO-2 (2 ranks: then resumes tp2 pp2's step-2 checkpoint through its layout-free copy)."""
    from ranks import run_on_ranks

    root = tmp_path_factory.mktemp("api-initialize")
    rows = {"train": tokenised_rows(tiny_llama, count=GLOBAL * STEPS + EVAL_ROWS)}
    rows["eval"] = {key: value[GLOBAL * STEPS:] for key, value in rows["train"].items()}
    torch.save(rows, root / "rows.pt")
    layouts = {"tp1-pp1": dict(tp=1, pp=1, dp=1, zero=1), "tp2-pp2": dict(tp=2, pp=2, dp=1, zero=1),
               "dp2-zero2": dict(tp=1, pp=1, dp=2, zero=2), "lora": dict(tp=1, pp=1, dp=1, zero=1)}
    for name, layout in layouts.items():
        plan = {"spec": spec_for(tiny_llama, root / name, **layout), "rows": str(root / "rows.pt"),
                "results": str(root / f"{name}.rank{{rank}}.json")}
        if name == "lora":
            plan["spec"]["training"]["lora"] = {"rank": 4, "alpha": 8.0}
            plan["export"] = str(root / "lora-hf")
        if name == "tp2-pp2":
            plan.update(checkpoints=str(root / "tp2-pp2-checkpoints"), export=str(root / "tp2-pp2-hf"), bad=True)
        if name == "tp1-pp1":
            plan["resave"] = str(root / "tp1-pp1-checkpoints")
        if name == "dp2-zero2":
            plan["resume_from"] = str(root / "tp2-pp2-checkpoints")
        (root / f"{name}.json").write_text(json.dumps(plan))
        run_on_ranks(__file__, root / f"{name}.json", nprocs=layout["tp"] * layout["pp"] * layout["dp"],
                     timeout=600)
    results = {name: [json.loads(path.read_text()) for path in sorted(root.glob(f"{name}.rank*.json"))]
               for name in layouts}
    return root, rows, results


def hf_loss(model_dir: Path, rows: dict[str, torch.Tensor]) -> float:
    """transformers' own loss of the rows: mean over every counted (shifted) label of the batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**rows).loss.item()


@pytest.mark.multiproc
def test_the_same_global_batch_gives_the_same_losses_at_every_layout(script_runs, tiny_llama):
    _, rows, results = script_runs
    first_batch = {key: value[:GLOBAL] for key, value in rows["train"].items()}
    reference = hf_loss(tiny_llama, first_batch)
    counted = int((first_batch["labels"][:, 1:] != -100).sum())
    results = {name: ranks for name, ranks in results.items() if name != "lora"}
    losses = {name: [step["loss"] for step in ranks[0]["steps"]] for name, ranks in results.items()}
    for name, ranks in results.items():
        assert all(rank["steps"] == ranks[0]["steps"] for rank in ranks), name  # every rank reports the same
        assert abs(losses[name][0] - reference) <= 1e-5, (name, losses[name][0], reference)
        assert ranks[0]["steps"][0]["tokens"] == counted
        assert losses[name][-1] < losses[name][0] - 0.05, losses[name]  # it learns
        for step, (mine, theirs) in enumerate(zip(losses[name], losses["tp1-pp1"])):
            assert abs(mine - theirs) <= 1e-5 * (step + 1), (name, losses[name], losses["tp1-pp1"])
        assert ranks[0]["steps"][0]["lr"] == pytest.approx(2e-3)


@pytest.mark.multiproc
def test_eval_and_the_export_agree_with_transformers(script_runs):
    root, rows, results = script_runs
    exported = hf_loss(root / "tp2-pp2-hf", rows["eval"])
    evaluations = {name: ranks[0]["eval"] for name, ranks in results.items() if name != "lora"}
    assert abs(evaluations["tp2-pp2"]["loss"] - exported) <= 1e-5, (evaluations, exported)
    counted = int((rows["eval"]["labels"][:, 1:] != -100).sum())
    for name, evaluation in evaluations.items():
        assert evaluation["tokens"] == counted, name  # the dp2 ranks' padding counted nothing
        assert abs(evaluation["loss"] - exported) <= 1e-4, (name, evaluation, exported)
    assert not (root / ".tp2-pp2-hf.mcore").exists()  # the intermediate megatron copy is gone


@pytest.mark.multiproc
def test_lora_trains_and_exports_the_merged_model_and_the_peft_adapter(script_runs, tiny_llama):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, rows, results = script_runs
    losses = [step["loss"] for step in results["lora"][0]["steps"]]
    first_batch = {key: value[:GLOBAL] for key, value in rows["train"].items()}
    assert abs(losses[0] - hf_loss(tiny_llama, first_batch)) <= 1e-5  # B = 0: the base model's loss
    assert losses[-1] < losses[0] - 0.01, losses
    tokens = rows["eval"]["input_ids"][:4]
    merged = AutoModelForCausalLM.from_pretrained(root / "lora-hf", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, root / "lora-hf-adapter").eval()
    with torch.no_grad():
        gap = (tuned(input_ids=tokens).logits - merged(input_ids=tokens).logits).abs().max().item()
    assert gap <= 1e-4, gap  # the adapter on the original = the merged export
    exported = hf_loss(root / "lora-hf", rows["eval"])
    assert abs(exported - results["lora"][0]["eval"]["loss"]) <= 1e-5
    assert exported < hf_loss(tiny_llama, rows["eval"]) - 0.01  # the merge carries what the adapters learned


@pytest.mark.multiproc
def test_a_checkpoint_resumes_at_another_layout(script_runs):
    _, _, results = script_runs
    resumed = results["dp2-zero2"][0]["resumed"]
    original = results["tp2-pp2"][0]["steps"][SAVE_AT:]
    assert resumed["step"] == SAVE_AT
    assert results["tp1-pp1"][0]["reloaded"] == [STEPS, STEPS]  # a step saved twice loads; an empty dir keeps it
    for mine, theirs in zip(resumed["steps"], original, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5, (resumed, original)


@pytest.mark.multiproc
def test_a_bad_micro_batch_is_named_on_every_rank(script_runs):
    _, _, results = script_runs
    expected = {"shape": "input_ids has shape [2, 31]", "dtype": "input_ids has dtype torch.float32",
                "vocab": "labels holds 250 outside the vocabulary [0, 250)", "count": "iterator ended after 3",
                "raises": "raised ValueError: broken reader", "replica": "passed different micro-batches"}
    ranks = results["tp2-pp2"]
    assert len(ranks) == 4
    for rank in ranks:
        for case in BAD_CASES:
            message = rank["bad"][case]["error"]
            assert expected[case] in message, (case, message)
        # the run goes on: nothing of the refused steps was computed
        assert rank["after_bad"]["loss"] > 0 and rank["step_after_bad"] == STEPS + 1


# --- the ranks' side ---------------------------------------------------------------------------------------


def rank_micro_batches(rows: dict, *, run, step: int):
    """This DP rank's contiguous share of the step's global batch, in micro-batches."""
    chosen = torch.arange(step * GLOBAL, (step + 1) * GLOBAL).view(run.dp_size, -1)[run.dp_rank]
    for piece in chosen.split(MICRO):
        yield {key: value[piece] for key, value in rows.items()}


def rank_eval_batches(rows: dict, *, run):
    mine = torch.arange(run.dp_rank, len(rows["input_ids"]), run.dp_size)
    for piece in mine.split(MICRO):
        batch = {key: value[piece] for key, value in rows.items()}
        if len(piece) < MICRO:  # a short last micro-batch: a row that counts nothing
            batch = {key: torch.cat([value, value[:1]]) for key, value in batch.items()}
            batch["labels"][-1] = -100
            batch["attention_mask"][-1] = 1
        yield batch


def bad_batches(case: str, rows: dict, *, run, step: int):
    """Step `step`'s micro-batches with one fault on one rank (the others pass good ones)."""
    good = list(rank_micro_batches(rows, run=run, step=step))
    culprit = {"shape": 3, "dtype": 2, "vocab": 1, "count": 0, "raises": 2, "replica": 1}[case]
    if run.rank != culprit:
        yield from good
        return
    first = dict(good[0])
    if case == "shape":
        first["input_ids"] = first["input_ids"][:, :-1]
    elif case == "dtype":
        first["input_ids"] = first["input_ids"].float()
    elif case == "vocab":
        first["labels"] = first["labels"].clone()
        first["labels"][0, 3] = 250
    elif case == "replica":
        first["input_ids"] = first["input_ids"].roll(1, dims=1)
    elif case == "raises":
        yield first
        raise ValueError("broken reader")
    yield from ([first] + good[1:])[: 3 if case == "count" else None]


def bad_batch_cases(run, rows: dict) -> dict:
    from toolkit.errors import DsmtError

    found = {}
    for case in BAD_CASES:
        start = time.perf_counter()
        try:
            run.train_step(bad_batches(case, rows, run=run, step=0))
            found[case] = {"error": None}
        except DsmtError as err:
            found[case] = {"error": str(err), "seconds": time.perf_counter() - start}
    return found


def worker(plan_path: str) -> None:
    from toolkit import api

    plan = json.loads(Path(plan_path).read_text())
    rows = torch.load(plan["rows"])
    run = api.initialize(plan["spec"])
    results = {"steps": []}
    for step in range(STEPS):
        results["steps"].append(run.train_step(rank_micro_batches(rows["train"], run=run, step=step)))
        if step + 1 == SAVE_AT and "checkpoints" in plan:
            run.save_checkpoint(plan["checkpoints"])
    results["eval"] = run.eval_step(rank_eval_batches(rows["eval"], run=run))
    if "export" in plan:
        run.export_hf(plan["export"])
    if "resave" in plan:  # the same step saved twice, then an empty directory loads nothing
        for _ in range(2):
            run.save_checkpoint(plan["resave"])
        results["reloaded"] = [run.load_checkpoint(plan["resave"]), run.load_checkpoint(Path(plan["resave"]) / "none")]
    if plan.get("bad"):
        results["bad"] = bad_batch_cases(run, rows["train"])
        results["after_bad"] = run.train_step(rank_micro_batches(rows["train"], run=run, step=0))
        results["step_after_bad"] = run.step
    if "resume_from" in plan:
        step = run.load_checkpoint(plan["resume_from"])
        steps = [run.train_step(rank_micro_batches(rows["train"], run=run, step=s)) for s in range(step, STEPS)]
        results["resumed"] = {"step": step, "steps": steps}
    Path(plan["results"].format(rank=run.rank)).write_text(json.dumps(results))


if __name__ == "__main__":
    import sys

    worker(sys.argv[1])
