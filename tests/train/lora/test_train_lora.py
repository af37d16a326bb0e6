"""dsmt LoRA runs (toolkit/train/lora/adapters.py) against a one-process HF + peft reference (reference_lora.py), and their
exports against peft: all runs in ONE 4-rank launch.

Both sides start from the same nonzero PEFT adapter (B != 0 at step 0, so every LoRA matrix gets a gradient from
the first step), fp32, warmup + cosine LR, weight decay, gradient clipping that acts on every step.
  * tp2-pp2: the megatron 1F1B schedule, every linear adapted (column and row bases, GQA qkv split over TP);
  * tp2-dp2-zero2-recompute: DeepSpeed's loop, ZeRO-2 over DP, full recompute, targets q_proj, v_proj, down_proj
    (k has no block in the fused qkv);
  * tp2-pp2-vpp2: interleaved schedule, the export gathers the VPP chunks (sequence parallelism: its gradient sums
    are checked against TP1 by test_tp2_lora_gradients_equal_tp1; no run of its own, the suite's time);
  * gpt2-tp2-dp2: Conv1D (transposed) weights and a packed c_attn; phi3-tp2-pp2: packed qkv_proj and gate_up_proj;
  * tp2-dp2-zero3: base weights and adapters partitioned over DP (persistence threshold 0: no parameter kept whole),
    gathered by DeepSpeed for each module's forward / backward, and into CPU copies for the merge and the export.
Checked per run: per-step loss and pre-clip grad norm (relative), the exported adapter against the reference's,
peft's `PeftModel.from_pretrained(original, final-hf-adapter)` logits against the merged final-hf's, and final-hf's
tensors against peft's own merge (`merge_and_unload`) of final-hf-adapter into the original checkpoint. `pytest -s` prints the figures."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch

from train_helpers import PARITY_TRAINING, read_metrics, write_peft_adapter, write_spec

RANK, ALPHA = 4, 8.0
LORA_GRAD_CLIP = 0.02  # below every step's pre-clip LoRA gradient norm here, so clipping acts on every step
RUNS = {
    "tp2-pp2": dict(model="llama", layout=dict(tp=2, pp=2, dp=1, zero=1), targets=None),
    # full recompute of every layer: the frozen embedding's output must still carry gradients into the blocks
    "tp2-dp2-zero2-recompute": dict(model="llama", layout=dict(tp=2, pp=1, dp=2, zero=2),
                                    targets=["q_proj", "v_proj", "down_proj"], training={"recompute": "full"}),
    "tp2-pp2-vpp2": dict(model="llama", layout=dict(tp=2, pp=2, vpp=2, dp=1, zero=1, micro=1, global_batch=4),
                         targets=["k_proj", "o_proj", "gate_proj"]),
    "gpt2-tp2-dp2": dict(model="gpt2", layout=dict(tp=2, pp=1, dp=2, zero=1), targets=None),  # Conv1D, packed qkv
    "phi3-tp2-pp2": dict(model="phi3", layout=dict(tp=2, pp=2, dp=1, zero=1), targets=None),  # packed qkv, gate_up
    # OLMo-2's post-norms follow the linear_proj / linear_fc2 deltas and its whole-projection q / k norms follow
    # linear_qkv's delta; StarCoder2: biases, GELU MLP (c_fc / c_proj), tied. (Granite's residual multipliers scale
    # the deltas outside the linears, as Llama's path: not run, the suite's time.)
    "olmo2-tp2-pp2": dict(model="olmo2", layout=dict(tp=2, pp=2, dp=1, zero=1), targets=None),
    "starcoder2-tp2-dp2": dict(model="starcoder2", layout=dict(tp=2, pp=1, dp=2, zero=1), targets=None),
    # Gemma 2: post-norms after linear_proj / linear_fc2's deltas, softcapped scores and logits, tied (Gemma 3's
    # per-head q / k norms after linear_qkv's delta are megatron's own, as Qwen3's: not run, the suite's time)
    "gemma2-tp2-pp2": dict(model="gemma2", layout=dict(tp=2, pp=2, dp=1, zero=1), targets=None),
    # ERNIE 4.5: its own attention class (interleaved-pair RoPE computed in fp32) after linear_qkv's delta, tied
    "ernie4_5-tp2-dp2": dict(model="ernie4_5", layout=dict(tp=2, pp=1, dp=2, zero=1), targets=None),
    "tp2-dp2-zero3": dict(model="llama", layout=dict(tp=2, pp=1, dp=2, zero=3), targets=None,
                          communication={"param_persistence_threshold_elements": 0}),
    # Llama-3.2-1B / Qwen2.5-0.5B style: tied embeddings at PP > 1 with an odd vocabulary (251 -> padded 256, split
    # over TP), the tied embedding trained too (PEFT's modules_to_save): its two copies, on the first and the last
    # stage, kept equal by summing their gradients, exported once in final-hf-adapter. (Frozen, the same copies
    # are only loaded, as every tied model's at PP > 1 in the parity tests: not run here, the suite's time.)
    "tied-embeddings-tp2-pp2": dict(model="llama_tied", layout=dict(tp=2, pp=2, dp=1, zero=1), targets=None,
                                    lora={"train_embeddings": True}),
    # Mixture-of-experts (issue 50): every routed expert's gate_up_proj / down_proj adapted (PEFT's fused
    # target_parameters), its adapters split over EP with the experts and over expert-TP as their linears, their
    # gradients reduced over the expert-DP group; full rows (no padding tokens routed). Qwen3-MoE at EP2 x DP4
    # (expert-DP 2: an all-reduce over all 4 DP ranks would mix two experts' gradients; ZeRO-2 partitions the
    # expert adapters' states over their expert-DP pair); Mixtral (per-expert w1 / w2 / w3 on disk) at PP2 x EP2;
    # a DeepSeek-V2-Lite-shaped model (multi-latent attention with a plain q_proj, a dense layer then an MoE one with
    # shared experts; PEFT redirects the dense and shared MLP's names to the routed experts, so those take none) at
    # TP2 x EP2: the experts' adapters split over expert-TP, MLA's down projections whole on each TP rank with their
    # gradients summed over TP under SP. (One rank: test_lora_moe.py's logits; EP2 -> EP4: the resharding launch.)
    "qwen3_moe-ep2-dp4-zero2": dict(model="qwen3_moe", layout=dict(tp=1, pp=1, dp=4, zero=2), targets=None,
                                    parallel={"ep": 2}, data=True),
    # Qwen2-MoE's dense layer MLP and gated shared expert (ordinary MLP linears: PEFT redirects nothing of
    # qwen2_moe) with the routed experts not targeted: all frozen, so DeepSpeed is not told of experts (it asserts
    # that some optimizer group holds them), every adapter reduced over all of DP
    "qwen2_moe-shared-ep2": dict(model="qwen2_moe", layout=dict(tp=1, pp=1, dp=4, zero=1),
                                 targets=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                                 parallel={"ep": 2}, data=True),
    # training.lora.export: adapter (no final-hf / final-mcore); the test merges it with `dsmt convert merge-lora`
    "mixtral-pp2-ep2": dict(model="mixtral", layout=dict(tp=1, pp=2, dp=2, zero=1, micro=1), targets=None,
                            parallel={"ep": 2}, data=True, lora={"export": "adapter"}),
    # ... and its router adapted too (named: frozen by default), whole on each TP rank as a duplicated linear
    "deepseek_v2-tp2-ep2": dict(model="deepseek_v2", layout=dict(tp=2, pp=1, dp=2, zero=1),
                                targets=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.gate.weight",
                                         "experts.gate_up_proj", "experts.down_proj"],
                                parallel={"ep": 2, "sequence_parallel": True}, data=True),
}
MOE_SEQ = 32  # the MoE runs' rows: records of exactly this many characters, unpacked (`full_rows`)


def full_rows(path: Path) -> Path:
    """Records of exactly MOE_SEQ characters (+ EOS = one full row each): no padding token is routed, so a
    micro-batch's routed tokens are the same in dsmt and the reference."""
    from train_helpers import STORIES

    texts = [json.loads(line)["text"][:MOE_SEQ] for line in STORIES.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts if len(text) == MOE_SEQ))
    return path


def write_init_adapter(model_dir, out_dir, *, targets, seed: int):
    """A PEFT adapter with random A and B (B scaled by 0.05 to keep the delta modest), saved by peft itself."""
    return write_peft_adapter(model_dir, out_dir, rank=RANK, alpha=ALPHA, targets=targets, seed=seed, b_scale=0.05)


@pytest.fixture(scope="module")
def lora_runs(tiny_llama, tmp_path_factory):
    from ranks import run_on_ranks

    from toolkit.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-runs")
    models = {"llama": tiny_llama, "gpt2": make_tiny_checkpoint(root / "gpt2", model_type="gpt2", seed=3),
              "phi3": make_tiny_checkpoint(root / "phi3", model_type="phi3", seed=4),
              "llama_tied": make_tiny_checkpoint(root / "llama-tied", model_type="llama", tie_word_embeddings=True,
                                                 vocab_size=251, seed=5),
              **{family: make_tiny_checkpoint(root / family, model_type=family, seed=7 + index)
                 for index, family in enumerate(("olmo2", "starcoder2", "gemma2", "ernie4_5"))},
              **{family: make_tiny_checkpoint(root / family, model_type=family, num_hidden_layers=2, seed=21)
                 for family in ("qwen3_moe", "mixtral", "deepseek_v2", "qwen2_moe")}}
    moe_rows = full_rows(root / "moe-rows.jsonl")
    specs = {}
    for index, (name, run) in enumerate(RUNS.items()):
        model_dir = models[run["model"]]
        adapter = write_init_adapter(model_dir, root / f"init-{name}", targets=run["targets"], seed=11 + index)
        lora = {"rank": RANK, "alpha": ALPHA, "targets": run["targets"], "init_adapter": str(adapter),
                **run.get("lora", {})}
        training = {**PARITY_TRAINING, "grad_clip": LORA_GRAD_CLIP, "lora": lora, **run.get("training", {})}
        extra = {"training": training, "parallel": run.get("parallel", {}),
                 "communication": run.get("communication", {})}
        rows = {"seq": MOE_SEQ} if run.get("data") else {}
        if run.get("data"):
            extra["data"] = {"path": str(moe_rows), "packing": False}
        specs[name] = write_spec(root / f"{name}.yaml", model_dir=model_dir, output_dir=root / name,
                                 steps=PARITY_TRAINING["train_steps"], extra=extra, **run["layout"], **rows)
    # trained to the end, then trained again from its step-3 checkpoint (test_lora_resume_continues_the_run); both
    # checkpoints hold hf/ (test_lora_checkpoints_hold_the_hf_export), which the resume ignores
    resume_training = {**PARITY_TRAINING, "grad_clip": LORA_GRAD_CLIP, "export_hf_interval": 3,
                       "lora": {"rank": RANK, "alpha": ALPHA, "init_adapter": str(root / "init-tp2-pp2")}}
    resume_spec = write_spec(root / "resume.yaml", model_dir=tiny_llama, output_dir=root / "resume",
                             steps=PARITY_TRAINING["train_steps"], checkpoint_interval=3, tp=2, pp=2, dp=1,
                             extra={"training": resume_training})
    plan = root / "plan.json"
    plan.write_text(json.dumps({"runs": {name: str(path) for name, path in specs.items()}, "model_dir": str(tiny_llama),
                                "grad_adapter": str(root / "init-tp2-pp2"), "results": str(root / "grads.json"),
                                "resume": str(resume_spec)}))
    run_on_ranks(__file__, plan, nprocs=4, timeout=1200)
    runs = {name: (spec, models[RUNS[name]["model"]]) for name, spec in specs.items()}
    return runs, json.loads((root / "grads.json").read_text())


def _peft_vs_merged(model_dir, output_dir) -> tuple[float, float]:
    """(max |logits of peft on the original - logits of final-hf|, max |final-hf - peft's own merge of
    final-hf-adapter into the original|) over every tensor, as transformers holds them (fused experts included;
    modules_to_save replace their tensors)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(original, output_dir / "final-hf-adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(output_dir / "final-hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits_gap = (peft_model(input_ids=tokens).logits - merged(input_ids=tokens).logits).abs().max().item()
    by_peft = peft_model.merge_and_unload().state_dict()
    exported = merged.state_dict()
    assert set(by_peft) == set(exported), set(by_peft) ^ set(exported)
    return logits_gap, max((exported[k] - by_peft[k]).abs().max().item() for k in exported)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(RUNS))
def test_lora_run_matches_peft_reference(name, lora_runs):
    from safetensors.torch import load_file

    from reference_lora import train_lora_reference

    spec_path, model_dir = lora_runs[0][name]
    output_dir = spec_path.parent / name
    metrics = read_metrics(output_dir)
    reference = train_lora_reference(spec_path)
    assert [r["step"] for r in metrics] == list(range(1, len(reference.losses) + 1))
    assert min(reference.grad_norms) > LORA_GRAD_CLIP, reference.grad_norms
    assert all(abs(r["lr"] - x) <= 1e-12 * max(x, 1e-30) for r, x in zip(metrics, reference.lrs))
    exported = load_file(output_dir / "final-hf-adapter" / "adapter_model.safetensors")
    assert set(exported) == set(reference.adapter)
    start = load_file(spec_path.parent / f"init-{name}" / "adapter_model.safetensors")
    figures = {
        "loss_rel": max(abs(r["loss"] - x) / x for r, x in zip(metrics, reference.losses)),
        "grad_norm_rel": max(abs(r["grad_norm"] - x) / x for r, x in zip(metrics, reference.grad_norms)),
        "adapter": max((exported[k] - reference.adapter[k]).abs().max().item() for k in exported),
        "moved": max((reference.adapter[k] - start[k]).abs().max().item() for k in start),
    }
    if RUNS[name].get("lora", {}).get("export") == "adapter":  # only the adapter: merged here, by dsmt, later
        from toolkit.cli import main

        assert not (output_dir / "final-hf").exists() and not (output_dir / "final-mcore").exists()
        assert main(["convert", "merge-lora", str(model_dir), str(output_dir / "final-hf-adapter"),
                     str(output_dir / "final-hf"), "--quiet"]) == 0
    figures["peft_vs_merged_logits"], figures["merged_vs_peft_merge"] = _peft_vs_merged(model_dir, output_dir)
    train_embeddings = RUNS[name].get("lora", {}).get("train_embeddings", False)
    if train_embeddings:
        embedding = exported["base_model.model.model.embed_tokens.weight"]
        original = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
        figures["embedding_moved"] = (embedding - original).abs().max().item()
    print(f"\n{name:<24}" + " | ".join(f"{key} {value:.2e}" for key, value in figures.items()))
    print(f"{'':<24}dsmt loss {[round(r['loss'], 6) for r in metrics]} grad_norm "
          f"{[round(r['grad_norm'], 5) for r in metrics]}")
    print(f"{'':<24}ref  loss {[round(x, 6) for x in reference.losses]} grad_norm "
          f"{[round(x, 5) for x in reference.grad_norms]}")
    config = json.loads((output_dir / "final-hf-adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    if train_embeddings:  # trained, exported once, tied under both names
        assert config["modules_to_save"] == ["embed_tokens"] and config["ensure_weight_tying"], config
        assert torch.equal(embedding, exported["base_model.model.lm_head.weight"])
        assert figures["embedding_moved"] > 1e-3, figures
    assert figures["loss_rel"] <= 1e-5 and figures["grad_norm_rel"] <= 1e-5, figures
    assert figures["adapter"] <= 2e-6 and figures["moved"] > 1e-3, figures
    assert figures["peft_vs_merged_logits"] <= 1e-4 and figures["merged_vs_peft_merge"] <= 1e-6, figures


@pytest.mark.multiproc
def test_lora_resume_continues_the_run(lora_runs):
    """A LoRA run resumed from its step-3 DeepSpeed checkpoint (adapters, their Adam moments, the LR schedule,
    the data position) repeats steps 4-6 of the run that went straight through, and exports the same adapter."""
    from safetensors.torch import load_file

    root = lora_runs[0]["tp2-pp2"][0].parent
    first = [json.loads(line) for line in (root / "resume-first-metrics.jsonl").read_text().splitlines()]
    resumed = read_metrics(root / "resume")
    assert [r["step"] for r in first] == [r["step"] for r in resumed] == list(range(1, 7))
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(resumed[3:], first[3:])]
    first_adapter = load_file(root / "resume-first-adapter" / "adapter_model.safetensors")
    resumed_adapter = load_file(root / "resume" / "final-hf-adapter" / "adapter_model.safetensors")
    adapter_gap = max((resumed_adapter[k] - first_adapter[k]).abs().max().item() for k in first_adapter)
    print(f"\nLoRA resume at step 3: steps 4-6 loss rel gap {max(gaps):.1e}, adapter gap {adapter_gap:.1e}")
    assert max(gaps) <= 1e-6 and adapter_gap <= 1e-7


@pytest.mark.multiproc
def test_lora_checkpoints_hold_the_hf_export(lora_runs):
    """training.export_hf_interval: 3 (= checkpoint_interval): each checkpoint holds hf/, the merged model as
    transformers loads it, and hf/adapter, the PEFT adapter (training.lora.export: both). The step-6 checkpoint,
    written by the run resumed from step 3's (whose hf/ the resume ignored), holds what its final export holds;
    step 3's the model half-way."""
    from transformers import AutoModelForCausalLM

    output_dir = lora_runs[0]["tp2-pp2"][0].parent / "resume"

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return {k: v for path in sorted(directory.glob("*.safetensors")) for k, v in load_file(path).items()}

    def same(a: dict, b: dict) -> bool:
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    last, middle = (output_dir / "checkpoints" / f"step_00000{step}" / "hf" for step in (6, 3))
    model = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32).state_dict()
    final = AutoModelForCausalLM.from_pretrained(output_dir / "final-hf", dtype=torch.float32).state_dict()
    assert same(model, final)
    assert same(tensors(last / "adapter"), tensors(output_dir / "final-hf-adapter"))
    assert not same(tensors(middle), tensors(last)) and not same(tensors(middle / "adapter"), tensors(last / "adapter"))
    assert not any(path.name.startswith(".hf") for path in output_dir.glob("checkpoints/*/.*"))  # no scratch left


@pytest.mark.multiproc
def test_tp2_lora_gradients_equal_tp1(lora_runs):
    """The gradient claims of toolkit/train/lora/adapters.py, one backward of the same batch at TP1 and TP2 (with and without
    SP): with the engine's TP sum every LoRA gradient equals TP1's; without it, the gradients marked partial
    (A everywhere, B of column bases, B of row bases under SP) differ, and B of row bases without SP already
    equals TP1's (so it must not be summed: it is not marked)."""
    figures = lora_runs[1]
    print("\nLoRA gradients vs TP1 (max |diff|): " + " | ".join(f"{k} {v:.2e}" for k, v in figures.items()))
    # measured: summed 6.7e-8, unsummed row B 3.1e-8 (largest gradient 0.10: a few float32 ulps); the partial
    # ones differ by 1.1e-2 to 1.0e-1 without the sum
    tolerance = 1e-6 * figures["largest"]
    for case in ("tp2", "tp2-sp"):
        assert figures[f"{case}-summed"] <= tolerance, figures
    assert figures["tp2-unsummed-row-B"] <= tolerance, figures
    for partial in ("tp2-unsummed-A", "tp2-unsummed-column-B", "tp2-sp-unsummed-row-B"):
        assert figures[partial] > 1e-3 * figures["largest"], (partial, figures)


# --- the per-rank worker (this file under torchrun): the gradient probe, then the training runs ---------------------

SEQ, MICRO = 16, 2


def lora_grads(*, model_dir: str, adapter_dir: str, tp: int, sp: bool, summed: bool) -> dict:
    """(PEFT key, "column"/"row") -> this rank's LoRA gradient after one backward of a fixed batch (the same on
    every rank) at TP `tp` (DP fills the 4 ranks)."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout, init_process_groups
    from toolkit.spec.schema import LoraSpec
    from toolkit.train.engine.tp_grads import sum_sequence_parallel_grads
    from toolkit.train.lora.adapters import adapted_linears
    from toolkit.train.lora.targets import LINEARS
    from toolkit.train.lora.apply import apply_lora
    from toolkit.adapters.peft_names import peft_key
    from toolkit.train.engine.loss import masked_token_loss_sum

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    layout = Layout(tp=tp, pp=1, dp=4 // tp, sp=sp)
    init_process_groups(layout=layout, dist_backend="gloo")
    backends.current().seed(0)
    chunks, info = load_model_chunks(checkpoint=Path(model_dir), layout=layout, params_dtype=torch.float32)
    apply_lora(chunks, settings=info.settings, lora=LoraSpec(rank=RANK, alpha=ALPHA, init_adapter=adapter_dir),
               seed=0)
    if summed:
        sum_sequence_parallel_grads(chunks)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, info.settings.vocab_size, (MICRO, SEQ + 1), generator=generator)
    logits = chunks[0](tokens[:, :-1], torch.arange(SEQ).expand(MICRO, SEQ), None)
    loss = masked_token_loss_sum(logits, labels=tokens[:, 1:], loss_mask=torch.ones(MICRO, SEQ)) / (MICRO * SEQ)
    loss.backward()
    grads = {}
    for _, linear, module in adapted_linears(chunks):
        for slot, path in module.lora.hf_paths.items():
            for matrix, params in (("lora_A", module.lora.lora_A), ("lora_B", module.lora.lora_B)):
                grads[peft_key(path, matrix), LINEARS[linear]] = params[str(slot)].grad.detach().clone()
    return grads


def grad_probe(plan: dict) -> dict:
    import torch.distributed as dist

    def worst(reference, other, keep=lambda key: True) -> float:
        value = max((other[k] - reference[k]).abs().max().item() for k in reference if keep(k))
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    args = dict(model_dir=plan["model_dir"], adapter_dir=plan["grad_adapter"])
    tp1 = lora_grads(tp=1, sp=False, summed=True, **args)
    tp2, tp2_sp = (lora_grads(tp=2, sp=sp, summed=True, **args) for sp in (False, True))
    plain, plain_sp = (lora_grads(tp=2, sp=sp, summed=False, **args) for sp in (False, True))
    is_a = lambda key: ".lora_A." in key[0]  # noqa: E731
    return {"largest": max(g.abs().max().item() for g in tp1.values()),
            "tp2-summed": worst(tp1, tp2), "tp2-sp-summed": worst(tp1, tp2_sp),
            "tp2-unsummed-A": worst(tp1, plain, is_a),
            "tp2-unsummed-column-B": worst(tp1, plain, lambda k: not is_a(k) and k[1] == "column"),
            "tp2-unsummed-row-B": worst(tp1, plain, lambda k: not is_a(k) and k[1] == "row"),
            "tp2-sp-unsummed-row-B": worst(tp1, plain_sp, lambda k: not is_a(k) and k[1] == "row")}


def worker(plan_path: str) -> None:
    import torch.distributed as dist

    plan = json.loads(Path(plan_path).read_text())
    dist.init_process_group("gloo")
    figures = grad_probe(plan)
    if dist.get_rank() == 0:
        Path(plan["results"]).write_text(json.dumps(figures))
    from train_helpers import train_runs  # tests/train is on the ranks' PYTHONPATH (tests/ranks.py helper_dirs)

    train_runs(plan)
    resume_after_step_3(plan["resume"])


def resume_after_step_3(spec_path: str) -> None:
    """Train the spec to its end (checkpoints at steps 3 and 6), keep its metrics and adapter, remove the step-6
    checkpoint and the exports, and run it again: it resumes after step 3."""
    import shutil

    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit.spec.load import load_spec
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.train.job.run import train

    spec = load_spec(spec_path)
    output_dir = Path(spec.training.output_dir)
    for attempt in range(2):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        train(job=job_of(spec=spec, report=Report(source=spec_path, problems=())))
        if attempt == 0 and dist.get_rank() == 0:
            shutil.copy(output_dir / "metrics.jsonl", output_dir.parent / "resume-first-metrics.jsonl")
            shutil.copytree(output_dir / "final-hf-adapter", output_dir.parent / "resume-first-adapter")
            for name in ("checkpoints/step_000006", "final-hf", "final-mcore", "final-hf-adapter"):
                shutil.rmtree(output_dir / name)
        dist.barrier()


if __name__ == "__main__":
    import sys

    worker(sys.argv[1])
