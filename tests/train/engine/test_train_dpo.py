"""`dsmt train` with training.method: dpo (toolkit/train/engine/preference.py) against an independent one-process HF +
torch reference (reference_dpo.py: its own tokenisation, log-prob sums, loss, AdamW, schedule): all runs in ONE
4-rank launch, fp32, warmup + cosine LR, weight decay, gradient clipping acting on every step.

  * full-tp2-pp2-cdpo: full fine-tuning, the reference a frozen copy at TP2 x PP2 (1F1B, the log-probs on the last
    stage), conservative DPO (label smoothing), one sequence per row, validation pairs (val_* metrics);
  * full-tp2-dp2-zero2-sp-ipo: DeepSpeed's loop with ZeRO-2 over DP2, sequence parallelism, IPO, conversational
    records (explicit and implicit prompts) with both sides of a pair packed in one row;
  * lora-tp2-pp2: LoRA, the reference the same model with its adapters off (no second copy);
  * precomputed-tp2-dp2-zero3: the reference log-probs computed once before training into the data cache (checked
    against the reference's own), ZeRO-3, hinge loss, packed pairs.
Checked per run: step 1's loss is the policy = reference value (ln 2 for the sigmoid loss), per-step loss, pre-clip
grad norm and TRL's metrics, and the exported weights (or adapter) against the reference's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from train_helpers import PARITY_TRAINING, REPO, read_metrics, read_validation, write_peft_adapter, write_spec

DATA = REPO / "examples" / "data"
DPO_GRAD_CLIP = 0.02
RUNS = {
    "full-tp2-pp2-cdpo": dict(layout=dict(tp=2, pp=2, dp=1, zero=1, micro=2, global_batch=4, seq=48),
                              dpo={"beta": 0.1, "label_smoothing": 0.1},
                              data={"path": str(DATA / "tiny_preferences.jsonl"), "packing": False,
                                    "validation_path": str(DATA / "tiny_preferences_val.jsonl")},
                              training={"eval_interval": 3}),
    "full-tp2-dp2-zero2-sp-ipo": dict(layout=dict(tp=2, pp=1, dp=2, zero=2, micro=1, global_batch=4, seq=136),
                                      dpo={"beta": 0.5, "loss": "ipo"}, parallel={"sequence_parallel": True},
                                      data={"path": str(DATA / "tiny_preferences_chat.jsonl")}),
    "lora-tp2-pp2": dict(layout=dict(tp=2, pp=2, dp=1, zero=1, micro=2, global_batch=4, seq=48),
                         dpo={"beta": 0.2}, lora=True,
                         data={"path": str(DATA / "tiny_preferences.jsonl"), "packing": False}),
    # reference-free: SimPO (average log-probs, a target margin) and ORPO (the chosen NLL per token over the global
    # batch, the odds ratio), both with no reference model at all
    "simpo-tp2-pp2": dict(layout=dict(tp=2, pp=2, dp=1, zero=1, micro=2, global_batch=4, seq=48), method="simpo",
                          dpo={"beta": 2.0, "gamma": 0.5, "label_smoothing": 0.1},
                          data={"path": str(DATA / "tiny_preferences.jsonl"), "packing": False}),
    "orpo-lora-tp2-dp2": dict(layout=dict(tp=2, pp=1, dp=2, zero=1, micro=1, global_batch=4, seq=96), method="orpo",
                              dpo={"beta": 0.2}, lora=True, data={"path": str(DATA / "tiny_preferences.jsonl"),
                                                                  "validation_path": str(DATA / "tiny_preferences_val.jsonl")}),
    "precomputed-tp2-dp2-zero3": dict(layout=dict(tp=2, pp=1, dp=2, zero=3, micro=1, global_batch=4, seq=96),
                                      dpo={"beta": 0.1, "loss": "hinge", "reference": "precomputed"},
                                      data={"path": str(DATA / "tiny_preferences.jsonl")}),
}
API_LIKE = "full-tp2-pp2-cdpo"  # the script's own loop (toolkit.api.initialize) trains this run's pairs
STARTING_LOSS = {"sigmoid": math.log(2), "ipo": None, "hinge": 1.0}  # ipo: (1 / (2 beta))^2


@pytest.fixture(scope="module")
def dpo_runs(tiny_llama, tmp_path_factory):
    from ranks import run_on_ranks

    root = tmp_path_factory.mktemp("dpo-runs")
    specs = {}
    for name, run in RUNS.items():
        method = run.get("method", "dpo")
        training = {**PARITY_TRAINING, "grad_clip": DPO_GRAD_CLIP, "method": method, method: run["dpo"],
                    **run.get("training", {})}
        if run.get("lora"):  # B = 0: the policy starts equal to its reference (the base with adapters off)
            adapter = write_peft_adapter(tiny_llama, root / f"init-{name}", rank=4, alpha=8.0, targets=None, seed=3,
                                         b_scale=0.0)
            training["lora"] = {"rank": 4, "alpha": 8.0, "init_adapter": str(adapter)}
        extra = {"training": training, "data": {"type": "preference", **run["data"]},
                 "parallel": run.get("parallel", {})}
        specs[name] = write_spec(root / f"{name}.yaml", model_dir=tiny_llama, output_dir=root / name,
                                 steps=PARITY_TRAINING["train_steps"], extra=extra, **run["layout"])
    api_spec = yaml.safe_load(specs[API_LIKE].read_text())
    del api_spec["data"]  # the script brings its pairs
    api_spec["training"].update(output_dir=str(root / "api"), eval_interval=None)
    plan = root / "plan.json"
    plan.write_text(json.dumps({"runs": {name: str(path) for name, path in specs.items()}, "api_spec": api_spec,
                                "results": str(root / "api.json")}))
    run_on_ranks(__file__, plan, nprocs=4, timeout=1200)
    return specs


def _starting_loss(dpo: dict) -> float:
    loss = dpo.get("loss", "sigmoid")
    return (1 / (2 * dpo["beta"])) ** 2 if loss == "ipo" else STARTING_LOSS[loss]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(RUNS))
def test_dpo_run_matches_the_reference(name, dpo_runs):
    from safetensors.torch import load_file

    from reference_dpo import train_dpo_reference

    spec_path = dpo_runs[name]
    output_dir = spec_path.parent / name
    metrics = read_metrics(output_dir)
    reference = train_dpo_reference(spec_path)
    assert [r["step"] for r in metrics] == list(range(1, len(reference.losses) + 1))
    assert min(reference.grad_norms) > DPO_GRAD_CLIP, reference.grad_norms
    assert all(abs(r["lr"] - x) <= 1e-12 * max(x, 1e-30) for r, x in zip(metrics, reference.lrs))
    if RUNS[name].get("method", "dpo") == "dpo":  # reference-free methods start where the model is
        assert abs(metrics[0]["loss"] - _starting_loss(RUNS[name]["dpo"])) < 1e-6, metrics[0]["loss"]
    names = set(reference.metrics[0])
    assert names >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                     "logps/rejected"}
    figures = {
        "loss_rel": max(abs(r["loss"] - x) / x for r, x in zip(metrics, reference.losses)),
        "grad_norm_rel": max(abs(r["grad_norm"] - x) / x for r, x in zip(metrics, reference.grad_norms)),
        "metrics": max(abs(r[key] - ref[key]) for r, ref in zip(metrics, reference.metrics) for key in names),
    }
    if RUNS[name].get("lora"):
        exported = load_file(output_dir / "final-hf-adapter" / "adapter_model.safetensors")
        assert set(exported) == set(reference.adapter)
        figures["adapter"] = max((exported[k] - reference.adapter[k]).abs().max().item() for k in exported)
        start = load_file(spec_path.parent / f"init-{name}" / "adapter_model.safetensors")
        figures["moved"] = max((reference.adapter[k] - start[k]).abs().max().item() for k in exported)
    else:
        exported = load_file(output_dir / "final-hf" / "model.safetensors")
        figures["weight"] = max((exported[k] - reference.state_dict[k]).abs().max().item() for k in exported)
    if RUNS[name]["dpo"].get("reference") == "precomputed":
        figures["ref_logps"] = _precomputed_vs_reference(output_dir, reference.ref_logps)
    print(f"\n{name:<28}" + " | ".join(f"{key} {value:.2e}" for key, value in figures.items()))
    print(f"{'':<28}dsmt loss {[round(r['loss'], 6) for r in metrics]} acc "
          f"{[r['rewards/accuracies'] for r in metrics]}")
    print(f"{'':<28}ref  loss {[round(x, 6) for x in reference.losses]}")
    assert reference.losses[-1] < reference.losses[0]  # it learns
    assert figures["loss_rel"] < 1e-5 and figures["grad_norm_rel"] < 1e-4 and figures["metrics"] < 1e-5, figures
    assert figures.get("weight", 0) < 1e-5 and figures.get("adapter", 0) < 1e-5, figures
    assert figures.get("moved", 1) > 1e-4 and figures.get("ref_logps", 0) < 1e-4, figures


def _precomputed_vs_reference(output_dir: Path, ref_logps) -> float:
    import numpy as np
    import torch

    (table_file,) = (output_dir / "data-cache").rglob("reference-logps-*.npy")
    table = torch.from_numpy(np.load(table_file))
    assert table.shape == ref_logps.shape, (table.shape, ref_logps.shape)
    return (table - ref_logps).abs().max().item()


@pytest.mark.multiproc
def test_dpo_validation_reports_trls_metrics_per_pair(dpo_runs):
    """val_loss is the mean DPO loss over the validation pairs, with TRL's metrics as val_*: ln 2 and zero rewards
    before the first step (policy = reference); after the last step the reference's trained weights give the same
    values over the validation records, tokenised and scored by the reference itself."""
    import torch

    from transformers import AutoTokenizer

    from reference import load_hf_model, read_jsonl
    from reference_dpo import dpo_metrics, pair_logps, pair_losses, tokenize_pairs, train_dpo_reference

    spec_path = dpo_runs["full-tp2-pp2-cdpo"]
    lines = read_validation(spec_path.parent / "full-tp2-pp2-cdpo")
    assert [line["step"] for line in lines] == [0, 3, 6]
    assert abs(lines[0]["val_loss"] - math.log(2)) < 1e-6 and lines[0]["val_pairs"] == 4
    assert lines[0]["val_rewards/margins"] == 0 and lines[0]["val_rewards/accuracies"] == 0

    run, data = RUNS["full-tp2-pp2-cdpo"], RUNS["full-tp2-pp2-cdpo"]["data"]
    model_dir = Path(yaml.safe_load(spec_path.read_text())["model"]["path"])
    pairs = tokenize_pairs(read_jsonl(Path(data["validation_path"])), tokenizer=AutoTokenizer.from_pretrained(model_dir),
                           seq_length=run["layout"]["seq"], packing=data["packing"]).pairs
    trained = load_hf_model(model_dir)
    missing, unexpected = trained.load_state_dict(train_dpo_reference(spec_path).state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: one tensor saved
    with torch.no_grad():
        ref, pi = pair_logps(load_hf_model(model_dir).eval(), pairs), pair_logps(trained.eval(), pairs)
        losses = pair_losses(pi_c=pi[:, 0], pi_r=pi[:, 1], ref_c=ref[:, 0], ref_r=ref[:, 1], beta=run["dpo"]["beta"],
                             loss="sigmoid", label_smoothing=run["dpo"]["label_smoothing"])
    expected = {"val_loss": losses.mean().item(), **{f"val_{k}": v for k, v in dpo_metrics(
        pi_c=pi[:, 0], pi_r=pi[:, 1], ref_c=ref[:, 0], ref_r=ref[:, 1], beta=run["dpo"]["beta"]).items()}}
    gaps = {key: abs(lines[-1][key] - value) for key, value in expected.items()}
    print(f"\nvalidation after step 6: {lines[-1]}\n  gaps to the reference: {gaps}")
    assert max(gaps.values()) < 1e-5, gaps


def hf_pairs(pairs, indices, *, seq_length: int) -> dict:
    """A script's DPO micro-batch (toolkit/train/engine/hf_pairs.py): each side right-padded to seq_length, labels
    -100 on the prompt and the padding, as a TRL-style collator gives them."""
    import torch

    batch = {}
    for side in ("chosen", "rejected"):
        ids = torch.zeros(len(indices), seq_length, dtype=torch.long)
        labels = torch.full((len(indices), seq_length), -100, dtype=torch.long)
        mask = torch.zeros(len(indices), seq_length, dtype=torch.long)
        for row, index in enumerate(indices):
            sequence = getattr(pairs[index], side)
            ids[row, :len(sequence.ids)] = torch.tensor(sequence.ids)
            counted = torch.tensor(sequence.counted, dtype=torch.bool)
            labels[row, :len(sequence.ids)] = torch.tensor(sequence.ids).masked_fill(~counted, -100)
            mask[row, :len(sequence.ids)] = 1
        batch.update({f"{side}_input_ids": ids, f"{side}_labels": labels, f"{side}_attention_mask": mask})
    return batch


def _api_run(plan: dict) -> None:
    """`toolkit.api.initialize` on a DPO spec and the script's own pairs (tokenised by the reference's rules, in
    the reference's order), then its validation pairs through `run.eval_step`."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from reference import global_sample_indices, read_jsonl
    from reference_dpo import tokenize_pairs
    from toolkit.api import initialize

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    spec = plan["api_spec"]
    training, data = spec["training"], RUNS[API_LIKE]["data"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"]["path"])
    read = lambda path: tokenize_pairs(read_jsonl(Path(path)), tokenizer=tokenizer,  # noqa: E731
                                       seq_length=training["seq_length"], packing=False).pairs
    pairs, validation = read(data["path"]), read(data["validation_path"])
    run = initialize(spec)
    micro, steps = training["micro_batch_size"], training["train_steps"]
    results = []
    for step in range(steps):  # dp = 1 at tp2 x pp2: this rank's micro-batches are the whole global batch
        order = global_sample_indices(step=step, global_batch_size=training["global_batch_size"],
                                      num_examples=len(pairs), seed=training["seed"], shuffle=True)
        results.append(run.train_step([hf_pairs(pairs, order[i:i + micro], seq_length=training["seq_length"])
                                       for i in range(0, len(order), micro)]))
    evaluated = run.eval_step([hf_pairs(validation, list(range(i, min(i + micro, len(validation)))),
                                        seq_length=training["seq_length"]) for i in range(0, len(validation), micro)])
    if dist.get_rank() == 0:
        Path(plan["results"]).write_text(json.dumps({"steps": results, "eval": evaluated}))
    run.close()


@pytest.mark.multiproc
def test_dpo_in_a_scripts_own_loop_trains_the_same_pairs(dpo_runs):
    """run.train_step with the script's own chosen / rejected micro-batches trains as `dsmt train` does: the same
    losses and metrics as the reference on the same pairs, and eval_step's validation loss after the last step
    equal to the dsmt run's."""
    from reference_dpo import train_dpo_reference

    results = json.loads((dpo_runs[API_LIKE].parent / "api.json").read_text())
    reference = train_dpo_reference(dpo_runs[API_LIKE])
    losses = [step["loss"] for step in results["steps"]]
    assert abs(losses[0] - math.log(2)) < 1e-6 and results["steps"][0]["tokens"] == 4  # pairs of the global batch
    assert max(abs(a - b) / b for a, b in zip(losses, reference.losses)) < 1e-5, (losses, reference.losses)
    assert max(abs(step[key] - ref[key]) for step, ref in zip(results["steps"], reference.metrics) for key in ref) < 1e-5
    final = read_validation(dpo_runs[API_LIKE].parent / API_LIKE)[-1]
    assert results["eval"]["tokens"] == final["val_pairs"]
    assert abs(results["eval"]["loss"] - final["val_loss"]) < 1e-5, (results["eval"], final)


if __name__ == "__main__":  # one rank of the launch: every `dsmt train` run, then the script's own loop
    import sys

    import torch.distributed as dist

    from train_helpers import train_runs

    dist.init_process_group("gloo")
    launch_plan = json.loads(Path(sys.argv[1]).read_text())
    train_runs(launch_plan)
    _api_run(launch_plan)


@pytest.mark.multiproc
def test_orpo_validation_is_the_nll_per_chosen_token_of_the_whole_set_minus_the_odds_term(dpo_runs):
    """ORPO's val_loss before step 1 (LoRA B = 0: the base model), by the reference's own scoring of the validation
    records: NLL over all their chosen tokens (one mean, whatever the split over ranks) - beta mean(log-sigmoid)."""
    import torch
    from transformers import AutoTokenizer

    from reference import load_hf_model, read_jsonl
    from reference_dpo import orpo_loss, pair_logps, tokenize_pairs

    name = "orpo-lora-tp2-dp2"
    spec_path, run = dpo_runs[name], RUNS[name]
    model_dir = Path(yaml.safe_load(spec_path.read_text())["model"]["path"])
    pairs = tokenize_pairs(read_jsonl(Path(run["data"]["validation_path"])),
                           tokenizer=AutoTokenizer.from_pretrained(model_dir), seq_length=run["layout"]["seq"],
                           packing=True).pairs
    with torch.no_grad():
        logps = pair_logps(load_hf_model(model_dir).eval(), pairs)
    counts = torch.tensor([[p.chosen.num_counted, p.rejected.num_counted] for p in pairs], dtype=torch.float32)
    expected = orpo_loss(pi_c=logps[:, 0], pi_r=logps[:, 1], n_c=counts[:, 0], n_r=counts[:, 1],
                         beta=run["dpo"]["beta"]).item()
    first = read_validation(spec_path.parent / name)[0]
    assert first["step"] == 0 and first["val_pairs"] == len(pairs) == 4
    assert abs(first["val_loss"] - expected) < 1e-5 * abs(expected), (first, expected)
    assert abs(first["val_nll_loss"] - first["val_loss"] - run["dpo"]["beta"] * first["val_log_odds_ratio"]) < 1e-5
