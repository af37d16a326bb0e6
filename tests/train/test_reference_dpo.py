"""The DPO reference (reference_dpo.py) on its own: its loss formulas against hand-computed values (and TRL's where
trl imports), its truncation and tokenisation rules on small cases, and a few steps of training on the tiny Llama."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import yaml
from reference_dpo import (METRIC_NAMES, ORPO_METRIC_NAMES, SIMPO_METRIC_NAMES, OrpoSettings, SimpoSettings,
                           kept_lengths, method_settings, orpo_log_odds, orpo_loss, orpo_metrics, pair_arrays,
                           pair_logps, pair_losses, record_pieces, simpo_metrics, simpo_pair_losses, tokenize_pairs,
                           train_dpo_reference)

LN2 = math.log(2.0)

RECORDS = [
    {"prompt": "Say hi.", "chosen": " Hi there!", "rejected": " No."},
    {"prompt": "Count: 1 2", "chosen": " 3 4", "rejected": " 7"},
    {"prompt": "Color of sky?", "chosen": " Blue.", "rejected": " Green, I think."},
    {"prompt": "Is fire hot?", "chosen": " Yes.", "rejected": " No, cold."},
    {"chosen": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi!"}],
     "rejected": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Go away."}]},
    {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5"}]},
]


# --- loss formulas ------------------------------------------------------------------------------------------------

def _losses(pi_c, pi_r, ref_c, ref_r, **kwargs):
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return pair_losses(pi_c=t(pi_c), pi_r=t(pi_r), ref_c=t(ref_c), ref_r=t(ref_r), **kwargs)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_sigmoid_at_reference_is_ln2(eps):
    losses = _losses([-3.0, -7.5], [-4.0, -2.0], [-3.0, -7.5], [-4.0, -2.0], beta=0.3, loss="sigmoid",
                     label_smoothing=eps)
    torch.testing.assert_close(losses, torch.full((2,), LN2, dtype=torch.float64))


def test_ipo_and_hinge_at_reference():
    same = ([-3.0], [-4.0], [-3.0], [-4.0])
    for beta in (0.1, 0.5):
        ipo = _losses(*same, beta=beta, loss="ipo", n_c=torch.tensor([3]), n_r=torch.tensor([5]))
        assert ipo.item() == pytest.approx(1 / (4 * beta**2))
        assert _losses(*same, beta=beta, loss="hinge").item() == pytest.approx(1.0)


def test_losses_by_hand():
    # pi_c - ref_c = 1.5, pi_r - ref_r = -0.5: delta = 2
    args = ([-1.5], [-4.5], [-3.0], [-4.0])
    beta, eps = 0.5, 0.2
    z = beta * 2.0
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert _losses(*args, beta=beta, loss="sigmoid").item() == pytest.approx(-math.log(sig(z)))
    assert _losses(*args, beta=beta, loss="sigmoid", label_smoothing=eps).item() == pytest.approx(
        -(1 - eps) * math.log(sig(z)) - eps * math.log(sig(-z)))
    assert _losses(*args, beta=beta, loss="hinge").item() == pytest.approx(0.0)
    assert _losses(*args, beta=0.25, loss="hinge").item() == pytest.approx(0.5)
    ipo = _losses(*args, beta=beta, loss="ipo", n_c=torch.tensor([3]), n_r=torch.tensor([0]))  # n_r clamps to 1
    assert ipo.item() == pytest.approx((1.5 / 3 - (-0.5) / 1 - 1 / (2 * beta)) ** 2)


def test_losses_match_trl():
    trl = pytest.importorskip("trl")
    pi_c, pi_r = torch.tensor([-5.0, -2.0, -9.0]), torch.tensor([-6.0, -1.0, -8.5])
    ref_c, ref_r = torch.tensor([-5.5, -2.5, -8.0]), torch.tensor([-5.0, -1.5, -9.0])
    n_c, n_r = torch.tensor([4.0, 2.0, 7.0]), torch.tensor([3.0, 5.0, 1.0])
    for loss, eps in (("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0)):
        trainer = SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), beta=0.3, label_smoothing=eps,
                                  loss_type=loss, reference_free=False, f_divergence_type="reverse_kl",
                                  f_divergence_params={}, use_weighting=False, args=SimpleNamespace())
        scale = (n_c, n_r) if loss == "ipo" else (1.0, 1.0)  # TRL 0.x averages the log-probs for ipo
        try:
            theirs = trl.DPOTrainer.dpo_loss(trainer, pi_c / scale[0], pi_r / scale[1], ref_c / scale[0],
                                             ref_r / scale[1])[0]
        except Exception as err:  # TRL 1.x has no dpo_loss; TRL 0.x does not import with transformers 5
            pytest.skip(f"TRL {trl.__version__}'s DPOTrainer.dpo_loss is not usable here: {type(err).__name__}: "
                        f"{err}")
        ours = pair_losses(pi_c=pi_c, pi_r=pi_r, ref_c=ref_c, ref_r=ref_r, beta=0.3, loss=loss, label_smoothing=eps,
                           n_c=n_c, n_r=n_r)
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_simpo_and_orpo_settings():
    assert method_settings({"method": "simpo"}) == SimpoSettings(beta=2.0, gamma=1.0, label_smoothing=0.0)
    assert method_settings({"method": "simpo", "simpo": {"beta": 3, "gamma": 0.5, "label_smoothing": 0.1}}) == \
        SimpoSettings(beta=3.0, gamma=0.5, label_smoothing=0.1)
    assert method_settings({"method": "orpo"}) == OrpoSettings(beta=0.1)
    assert method_settings({"method": "orpo", "orpo": {"beta": 0.25}}) == OrpoSettings(beta=0.25)
    with pytest.raises(ValueError):
        method_settings({"method": "kto"})


def test_simpo_by_hand():
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    # avg_c = -3 / 2 = -1.5, avg_r = -8 / 4 = -2: beta 2, gamma 1 gives z = 0, ln 2 for any smoothing
    pi_c, pi_r, n_c, n_r = t([-3.0, -1.0]), t([-8.0, -6.0]), t([2, 4]), t([4, 3])
    avg_c, avg_r = pi_c / n_c, pi_r / n_r
    for eps in (0.0, 0.2):
        assert simpo_pair_losses(avg_c=avg_c[:1], avg_r=avg_r[:1], beta=2.0, gamma=1.0,
                                 label_smoothing=eps).item() == pytest.approx(LN2)
    # second pair: avg_c = -0.25, avg_r = -2: z = 2.5 * 1.75 - 0.5 = 3.875; first: z = 2.5 * 0.5 - 0.5 = 0.75
    for eps in (0.0, 0.3):
        losses = simpo_pair_losses(avg_c=avg_c, avg_r=avg_r, beta=2.5, gamma=0.5, label_smoothing=eps)
        expected = [-(1 - eps) * math.log(_sig(z)) - eps * math.log(_sig(-z)) for z in (0.75, 3.875)]
        assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    # rewards from the averaged log-probs: beta * avg
    metrics = simpo_metrics(pi_c=pi_c, pi_r=pi_r, n_c=n_c.long(), n_r=n_r.long(), beta=2.0)
    assert sorted(metrics) == sorted(SIMPO_METRIC_NAMES)
    assert metrics == pytest.approx({"rewards/chosen": 2 * (-1.5 - 0.25) / 2, "rewards/rejected": 2 * (-2 - 2) / 2,
                                     "rewards/accuracies": 1.0, "rewards/margins": 2 * (0.5 + 1.75) / 2,
                                     "logps/chosen": (-1.5 - 0.25) / 2, "logps/rejected": -2.0})


def test_orpo_by_hand():
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    pi_c, pi_r, n_c, n_r = t([-2.0, -6.0, -1.0]), t([-3.0, -4.0, -1.0]), t([4, 3, 2]), t([2, 8, 2])
    avg_c, avg_r = [-0.5, -2.0, -0.5], [-1.5, -0.5, -0.5]
    odds = [(c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r))) for c, r in zip(avg_c, avg_r)]
    assert odds[2] == 0.0  # equal averages: even odds
    assert orpo_log_odds(avg_c=pi_c / n_c, avg_r=pi_r / n_r).tolist() == pytest.approx(odds, rel=1e-12)
    nll = 9.0 / 9.0  # -(-2 - 6 - 1) / (4 + 3 + 2): one token-level mean, not a mean of per-sequence means
    ratio = [math.log(_sig(x)) for x in odds]
    beta = 0.25
    expected = nll - beta * sum(ratio) / 3
    assert orpo_loss(pi_c=pi_c, pi_r=pi_r, n_c=n_c, n_r=n_r, beta=beta).item() == pytest.approx(expected, rel=1e-12)
    # the last pair alone: NLL 1 / 2, ratio -ln 2
    assert orpo_loss(pi_c=pi_c[2:], pi_r=pi_r[2:], n_c=n_c[2:], n_r=n_r[2:], beta=beta).item() == pytest.approx(
        0.5 + beta * LN2, rel=1e-12)
    # micro-batch parts scaled by the global batch's chosen tokens and pairs sum to the global batch's loss
    parts = [orpo_loss(pi_c=pi_c[a:b], pi_r=pi_r[a:b], n_c=n_c[a:b], n_r=n_r[a:b], beta=beta,
                       chosen_tokens=n_c.sum(), num_pairs=3) for a, b in ((0, 1), (1, 3))]
    assert sum(p.item() for p in parts) == pytest.approx(expected, rel=1e-12)
    metrics = orpo_metrics(pi_c=pi_c, pi_r=pi_r, n_c=n_c.long(), n_r=n_r.long(), beta=beta)
    assert sorted(metrics) == sorted(ORPO_METRIC_NAMES)
    rc, rr = [beta * x for x in avg_c], [beta * x for x in avg_r]
    assert metrics == pytest.approx({
        "rewards/chosen": sum(rc) / 3, "rewards/rejected": sum(rr) / 3, "rewards/accuracies": 1 / 3,
        "rewards/margins": (sum(rc) - sum(rr)) / 3, "logps/chosen": sum(avg_c) / 3, "logps/rejected": sum(avg_r) / 3,
        "nll_loss": nll, "log_odds_ratio": sum(ratio) / 3, "log_odds_chosen": sum(odds) / 3}, rel=1e-7)  # accuracies: f32


# --- truncation and tokenisation ----------------------------------------------------------------------------------

def test_kept_lengths():
    # fits: nothing cut
    assert kept_lengths(p_c=3, c_c=4, p_r=3, c_r=2, window=10, packing=False) == (3, 4, 3, 2)
    assert kept_lengths(p_c=2, c_c=3, p_r=2, c_r=3, window=10, packing=True) == (2, 3, 2, 3)
    # unpacked: the prompt keeps L - max(c) = 4 tokens; then chosen 6 fits, rejected 2 fits
    assert kept_lengths(p_c=8, c_c=6, p_r=8, c_r=2, window=10, packing=False) == (4, 6, 4, 2)
    # unpacked: a completion longer than L leaves one prompt token; it is cut to L - 1
    assert kept_lengths(p_c=5, c_c=12, p_r=5, c_r=3, window=10, packing=False) == (1, 9, 1, 3)
    # packed: prompts keep (20 - 6 - 4) // 2 = 5 each
    assert kept_lengths(p_c=9, c_c=6, p_r=9, c_r=4, window=20, packing=True) == (5, 6, 5, 4)
    # packed: completions too long; prompts 1 each, A = 18, short (4) kept whole, long gets 14
    assert kept_lengths(p_c=9, c_c=30, p_r=9, c_r=4, window=20, packing=True) == (1, 14, 1, 4)
    # packed: both long: short = A // 2 = 9, long = 9
    assert kept_lengths(p_c=9, c_c=30, p_r=9, c_r=12, window=20, packing=True) == (1, 9, 1, 9)
    # an empty prompt stays empty
    assert kept_lengths(p_c=0, c_c=30, p_r=0, c_r=30, window=21, packing=True) == (0, 10, 0, 11)


def test_string_and_chat_tokenisation(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)  # character-level, no BOS, no chat template
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    (pc, cc, fc), (pr, cr, fr) = record_pieces(tok, RECORDS[0])
    assert (pc, cc, fc) == (ids("Say hi."), ids(" Hi there!") + [eos], [1] * 11)
    assert (pr, cr, fr) == (pc, ids(" No.") + [eos], [1] * 5)
    # implicit prompt, fallback rendering: prompt "user: Hello?\nassistant: ", completion "Hi!\n" + EOS
    (pc, cc, fc), (pr, cr, _) = record_pieces(tok, RECORDS[4])
    assert pc == pr == ids("user: Hello?\nassistant: ")
    assert (cc, fc) == (ids("Hi!\n") + [eos], [1] * 5)
    assert cr == ids("Go away.\n") + [eos]
    # an assistant turn inside the prompt is not counted; a multi-turn completion counts its assistant turns only
    record = {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
              "chosen": [{"role": "assistant", "content": "c"}, {"role": "user", "content": "d"},
                         {"role": "assistant", "content": "e"}],
              "rejected": [{"role": "assistant", "content": "f"}]}
    (pc, cc, fc), _ = record_pieces(tok, record)
    assert pc == ids("user: a\nassistant: b\nassistant: ")
    assert cc == ids("c\nuser: d\nassistant: e\n") + [eos]
    assert fc == [1, 1] + [0] * len("user: d\nassistant: ") + [1, 1, 1]
    # a chat template: labels on the assistant text and the template's end of turn, no EOS appended
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    (pc, cc, fc), _ = record_pieces(tok, RECORDS[5])
    assert (pc, cc, fc) == (ids("user: 2+2?;\nassistant: "), ids("4;\n"), [1, 1, 1])


def test_pairs_truncation_drop_and_arrays(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    records = RECORDS[:4] + [{"prompt": "x" * 40, "chosen": "y" * 40, "rejected": "z" * 3},
                             {"prompt": "p", "chosen": "", "rejected": "q"}]
    packed = tokenize_pairs(records, tokenizer=tok, seq_length=64, packing=True)
    # the long one is cut (kept: prompts (65 - 41 - 4) // 2 = 10 each, then 10 + 41 + 10 + 4 = 65 fits); the last
    # keeps its EOS-only completion: nothing dropped
    assert (len(packed.pairs), packed.num_truncated, packed.num_dropped) == (6, 1, 0)
    long = packed.pairs[4]
    assert (len(long.chosen.ids), len(long.rejected.ids)) == (51, 14)
    assert long.chosen.num_counted == 41 and long.rejected.num_counted == 4
    # packed, the prompt is cut to (L - c_c - c_r) // 2 whenever both prompts and completions do not fit in L
    tight = tokenize_pairs(records[:1], tokenizer=tok, seq_length=24, packing=True).pairs[0]  # 7 + 11 + 7 + 5 > 25
    assert (len(tight.chosen.ids), len(tight.rejected.ids)) == (4 + 11, 4 + 5)
    unpacked = tokenize_pairs(records, tokenizer=tok, seq_length=8, packing=False)
    assert unpacked.num_truncated >= 3 and unpacked.num_dropped == 0
    arrays = pair_arrays(packed.pairs, seq_length=64, pad=tok.eos_token_id, packing=True)
    assert arrays["token_ids"].shape == (6, 65) and arrays["loss_mask"].shape == (6, 64)
    first = packed.pairs[0]
    n = len(first.chosen.ids)
    assert arrays["position_ids"][0, n].item() == 0 and arrays["position_ids"][0, n - 1].item() == n - 1
    assert arrays["loss_mask"][0].sum().item() == first.chosen.num_counted + first.rejected.num_counted
    assert arrays["sequence"][0].sum().item() == first.rejected.num_counted
    split = pair_arrays(packed.pairs, seq_length=64, pad=tok.eos_token_id, packing=False)
    assert split["token_ids"].shape == (12, 65) and split["sequence"][0].sum().item() == 0


# --- training -----------------------------------------------------------------------------------------------------

def _spec(tmp_path, model_dir, *, steps=4, extra_training=None, packing=True):
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    training = {"seq_length": 48, "global_batch_size": 6, "micro_batch_size": 2, "lr": 3e-3, "min_lr": 3e-3,
                "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0,
                "train_steps": steps, "seed": 3, "method": "dpo", "dpo": {"beta": 0.5, "loss": "sigmoid"},
                **(extra_training or {})}
    spec = {"model": {"path": str(model_dir)}, "data": {"path": str(data), "shuffle": False, "packing": packing},
            "training": training}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_full_fine_tuning_run(tiny_llama, tmp_path):
    run = train_dpo_reference(_spec(tmp_path, tiny_llama))
    assert run.losses[0] == pytest.approx(LN2, abs=1e-6)  # policy == reference at the first step
    assert all(math.isfinite(x) for x in run.losses + run.grad_norms)
    assert all(b < a for a, b in zip(run.losses, run.losses[1:])), run.losses
    assert run.lrs == [3e-3] * 4 and run.ref_logps.shape == (6, 2) and (run.ref_logps < 0).all()
    assert [sorted(m) for m in run.metrics] == [sorted(METRIC_NAMES)] * 4
    first, last = run.metrics[0], run.metrics[-1]
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-6) and first["rewards/accuracies"] == 0
    assert first["logps/chosen"] == pytest.approx(run.ref_logps[:, 0].mean().item(), rel=1e-6)
    assert last["rewards/margins"] > 0 and last["rewards/accuracies"] > 0.5
    assert run.adapter is None and "lm_head.weight" in run.state_dict


def test_lora_run(tiny_llama, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "init")  # B = 0: policy == reference at the start
    lora = {"rank": 4, "alpha": 8, "init_adapter": str(tmp_path / "init")}
    run = train_dpo_reference(_spec(tmp_path, tiny_llama, steps=3, packing=False,
                                    extra_training={"lora": lora, "lr": 2e-2, "min_lr": 2e-2,
                                                    "dpo": {"beta": 0.5, "loss": "ipo"}}))
    assert run.losses[0] == pytest.approx(1 / (4 * 0.5**2), rel=1e-6)
    assert all(b < a for a, b in zip(run.losses, run.losses[1:])), run.losses
    assert run.state_dict is None and any("lora_B" in k and v.abs().sum() > 0 for k, v in run.adapter.items())


def test_simpo_full_fine_tuning_run(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    simpo = {"beta": 2.0, "gamma": 0.5}
    run = train_dpo_reference(_spec(tmp_path, tiny_llama, steps=3, extra_training={"method": "simpo",
                                                                                      "simpo": simpo}))
    assert run.ref_logps is None and run.adapter is None and "lm_head.weight" in run.state_dict
    assert all(math.isfinite(x) for x in run.losses + run.grad_norms)
    assert all(b < a for a, b in zip(run.losses, run.losses[1:])), run.losses
    assert [sorted(m) for m in run.metrics] == [sorted(SIMPO_METRIC_NAMES)] * 3
    # the first step from the starting model, independently: the global batch is all 6 pairs (no shuffle)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    pairs = tokenize_pairs(RECORDS, tokenizer=tok, seq_length=48, packing=True).pairs
    with torch.no_grad():
        pi = pair_logps(AutoModelForCausalLM.from_pretrained(tiny_llama).eval(), pairs)
    n = torch.tensor([[p.chosen.num_counted, p.rejected.num_counted] for p in pairs], dtype=torch.float32)
    avg = pi / n
    z = 2.0 * (avg[:, 0] - avg[:, 1]) - 0.5
    assert run.losses[0] == pytest.approx(-torch.nn.functional.logsigmoid(z).mean().item(), rel=1e-5)
    assert run.metrics[0]["logps/chosen"] == pytest.approx(avg[:, 0].mean().item(), rel=1e-5)
    assert run.metrics[0]["rewards/rejected"] == pytest.approx(2.0 * avg[:, 1].mean().item(), rel=1e-5)
    assert run.metrics[-1]["rewards/margins"] > run.metrics[0]["rewards/margins"]


def test_orpo_lora_run(tiny_llama, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "init")
    lora = {"rank": 4, "alpha": 8, "init_adapter": str(tmp_path / "init")}
    run = train_dpo_reference(_spec(tmp_path, tiny_llama, steps=3, packing=False,
                                    extra_training={"lora": lora, "lr": 2e-2, "min_lr": 2e-2, "method": "orpo",
                                                    "orpo": {"beta": 0.5}}))
    assert run.ref_logps is None and run.state_dict is None
    assert all(math.isfinite(x) for x in run.losses + run.grad_norms)
    assert all(b < a for a, b in zip(run.losses, run.losses[1:])), run.losses
    assert [sorted(m) for m in run.metrics] == [sorted(ORPO_METRIC_NAMES)] * 3
    for loss, m in zip(run.losses, run.metrics):  # the step loss is NLL - beta * mean(logsigmoid(log odds))
        assert loss == pytest.approx(m["nll_loss"] - 0.5 * m["log_odds_ratio"], rel=1e-5)
        assert m["nll_loss"] > 0 and m["log_odds_ratio"] < 0
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in run.adapter.items())
