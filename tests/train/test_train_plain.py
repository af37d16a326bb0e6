"""Models without a megatron-core adapter train with DeepSpeed ZeRO data parallelism only (toolkit/train/plain.py).

One 2-rank gloo launch runs every multi-process scenario (imports cost ~6 s per process): a tiny ResNet at ZeRO-1
and ZeRO-3, a tiny BERT masked LM at ZeRO-2, and the same BERT at ZeRO-1 for loss parity with one process and
torch AdamW on the same global batches (fp32, constant lr, no clipping)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from toolkit.errors import DsmtError
from toolkit.launch import free_port
from toolkit.train.plain import (PLAIN_NOTICE, PlainBatches, check_plain_layout, is_plain_model, load_plain_model,
                                 model_kind, plain_notice)

REPO = Path(__file__).resolve().parents[2]
STEPS, MICRO, GRAD_ACCUM, DP = 3, 2, 2, 2
LR, SEED, SEQ = 1e-3, 11, 16
PARITY_TOLERANCE = 1e-5

# Each scenario: model directory fixture name, ZeRO stage, whether to export.
SCENARIOS = {"resnet-zero1": ("resnet", 1), "resnet-zero3": ("resnet", 3), "bert-zero2": ("bert", 2),
             "bert-zero1": ("bert", 1)}

WORKER = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from toolkit.train.plain import PlainBatches, PlainEngine, export_plain, load_plain_model, plain_notice

    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name, run in spec["runs"].items():
        model = load_plain_model(Path(run["model_dir"]), dtype=torch.float32)
        plain = PlainEngine(model=model, ds_config=run["ds_config"])
        batches = PlainBatches(model_config=model.config, micro_batch_size=spec["micro"],
                               num_microbatches=spec["grad_accum"], dp_rank=rank, dp_size=dist.get_world_size(),
                               seed=spec["seed"], seq_length=spec["seq"])
        stats = [plain.train_step(batches.batches_for_step(step)) for step in range(spec["steps"])]
        export_plain(engine=plain.engine, out_dir=Path(run["out_dir"]))
        results[name] = {"loss": [s.loss for s in stats], "grad_norm": [s.grad_norm for s in stats],
                         "lr": [s.lr for s in stats],
                         "notice": plain_notice(model_type=model.config.model_type,
                                                zero_stage=plain.engine.zero_optimization_stage())}
    if rank == 0:
        Path(spec["results"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
''')


def ds_config(*, zero_stage: int) -> dict:
    return {
        "train_batch_size": MICRO * GRAD_ACCUM * DP, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                                  "torch_adam": True}},  # torch AdamW: no FusedAdam JIT build
        "zero_optimization": {"stage": zero_stage}, "steps_per_print": 10**9,
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import BertConfig, BertForMaskedLM, ResNetConfig, ResNetForImageClassification

    root = tmp_path_factory.mktemp("plain-models")
    torch.manual_seed(0)
    resnet = ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                       depths=[1, 1], layer_type="basic", num_labels=3))
    resnet.save_pretrained(root / "resnet")
    # Dropout off: the parity reference must compute exactly what the ranks compute.
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))
    bert.save_pretrained(root / "bert")
    return {"resnet": root / "resnet", "bert": root / "bert"}


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory) -> tuple[dict, Path]:
    """Every scenario, trained in one 2-rank launch; returns (per-scenario results, output root)."""
    root = tmp_path_factory.mktemp("plain-runs")
    runs = {name: {"model_dir": str(models[model]), "ds_config": ds_config(zero_stage=stage),
                   "out_dir": str(root / name / "final-hf")} for name, (model, stage) in SCENARIOS.items()}
    spec = {"runs": runs, "steps": STEPS, "micro": MICRO, "grad_accum": GRAD_ACCUM, "seed": SEED, "seq": SEQ,
            "results": str(root / "results.json")}
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))  # tests/conftest.py sets it too
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={DP}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(root / "worker.py"),
               str(root / "spec.json")]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads((root / "results.json").read_text()), root


# ---- pure unit tests -------------------------------------------------------------------------------------------

def test_plain_models_are_those_without_an_adapter(models, tmp_path):
    assert is_plain_model(models["resnet"]) and is_plain_model(models["bert"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_plain_model(tmp_path)


def test_layout_with_tp_or_pp_is_refused_with_the_rule():
    check_plain_layout(tp=1, pp=1)
    with pytest.raises(DsmtError) as err:
        check_plain_layout(tp=2, pp=1, model_type="resnet")
    message = str(err.value)
    assert "model_type resnet has no megatron-core adapter" in message
    assert "set parallel.tp=1 and parallel.pp=1" in message and "tp=2, pp=1" in message
    assert "adapters exist for: llama" in message
    with pytest.raises(DsmtError, match="pp=2"):
        check_plain_layout(tp=1, pp=2)


def test_notice_text():
    assert plain_notice(model_type="bert", zero_stage=2) == PLAIN_NOTICE.format(model_type="bert", stage=2) == (
        "model_type bert has no megatron-core adapter: training with DeepSpeed ZeRO-2 data parallelism only "
        "(tp=1, pp=1)")


def test_load_picks_the_class_named_in_config(models, tmp_path):
    assert type(load_plain_model(models["resnet"], dtype=torch.float32)).__name__ == "ResNetForImageClassification"
    assert type(load_plain_model(models["bert"], dtype=torch.bfloat16)).__name__ == "BertForMaskedLM"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet", "architectures": ["NoSuchModel"]}))
    with pytest.raises(DsmtError, match="AutoModelForCausalLM cannot load it"):
        load_plain_model(tmp_path, dtype=torch.float32)


@pytest.mark.parametrize("model", ["resnet", "bert"])
def test_batches_are_deterministic_disjoint_rank_slices_of_the_global_batch(models, model):
    config = load_plain_model(models[model], dtype=torch.float32).config
    common = dict(model_config=config, micro_batch_size=MICRO, num_microbatches=GRAD_ACCUM, seed=SEED, seq_length=SEQ)
    ranks = [PlainBatches(dp_rank=r, dp_size=DP, **common) for r in range(DP)]
    reference = PlainBatches(dp_rank=0, dp_size=1, **{**common, "num_microbatches": GRAD_ACCUM * DP})
    for step in (0, 2):
        per_rank = [b.batches_for_step(step) for b in ranks]
        in_order = [per_rank[r][m] for m in range(GRAD_ACCUM) for r in range(DP)]  # (micro-batch, rank) order
        joined = {k: torch.cat([mb[k] for mb in in_order]) for k in in_order[0]}
        expected = reference.global_batch_for_step(step)
        assert joined.keys() == expected.keys() and all(torch.equal(joined[k], expected[k]) for k in joined)
        again = PlainBatches(dp_rank=1, dp_size=DP, **common).batches_for_step(step)
        assert all(torch.equal(again[0][k], per_rank[1][0][k]) for k in again[0])  # a pure function
    first_key = next(iter(expected))
    assert not torch.equal(ranks[0].batches_for_step(0)[0][first_key], ranks[0].batches_for_step(1)[0][first_key])
    if model == "resnet":
        assert expected["pixel_values"].shape == (MICRO * GRAD_ACCUM * DP, 3, 32, 32)
        assert expected["labels"].dtype == torch.int64 and int(expected["labels"].max()) < 3
    else:
        masked = expected["labels"] != -100
        assert masked.any(dim=1).all() and 0.05 < masked.float().mean() < 0.4
        assert torch.equal(expected["labels"][masked], expected["labels"][masked].clamp(0, 62))
        assert (expected["input_ids"][masked] == config.vocab_size - 1).all()


def test_unsupported_model_kind_names_the_supported_ones():
    from transformers import BertConfig

    with pytest.raises(DsmtError, match="supported kinds: image_classification .*masked_lm .*causal_lm"):
        model_kind(BertConfig(architectures=["BertForQuestionAnswering"]))
    with pytest.raises(DsmtError, match=r"architectures=\[\]"):
        model_kind(BertConfig())


# ---- multi-process: one launch, several checks -----------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["resnet-zero1", "resnet-zero3", "bert-zero2"])
def test_trains_at_dp2_and_exports_a_loadable_changed_model(name, trained, models):
    results, root = trained
    run = results[name]
    model, stage = SCENARIOS[name]
    print(name, "losses", run["loss"], "grad norms", run["grad_norm"])
    assert all(torch.isfinite(torch.tensor(run["loss"])))
    assert len(set(run["loss"])) == STEPS  # every step trains on new batches with new weights
    assert run["lr"] == [LR] * STEPS
    assert run["notice"] == plain_notice(model_type=model, zero_stage=stage)
    exported = load_plain_model(root / name / "final-hf", dtype=torch.float32).state_dict()
    start = load_plain_model(models[model], dtype=torch.float32).state_dict()
    assert sorted(exported) == sorted(start)
    moved = max((exported[k].float() - start[k].float()).abs().max().item() for k in exported)
    print(name, "max |Δweight| from the start", moved)
    assert moved > 1e-4


def reference_training(*, model_dir: Path) -> tuple[list[float], dict]:
    """One process, torch AdamW, the whole global batch as GRAD_ACCUM * DP micro-batches; the loss is their mean,
    as DeepSpeed's 1/GA scaling and DP averaging make it."""
    model = load_plain_model(model_dir, dtype=torch.float32)
    model.train()
    batches = PlainBatches(model_config=model.config, micro_batch_size=MICRO, num_microbatches=GRAD_ACCUM * DP,
                           dp_rank=0, dp_size=1, seed=SEED, seq_length=SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        loss = torch.stack([model(**batch).loss for batch in batches.batches_for_step(step)]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.multiproc
def test_zero_stages_train_alike(trained):
    results, _ = trained
    assert results["resnet-zero3"]["loss"] == pytest.approx(results["resnet-zero1"]["loss"], abs=PARITY_TOLERANCE)


@pytest.mark.multiproc
def test_bert_zero1_dp2_matches_single_process_torch_adamw(trained, models):
    results, root = trained
    losses = results["bert-zero1"]["loss"]
    reference_losses, reference_state = reference_training(model_dir=models["bert"])
    print("losses", losses, "reference", reference_losses)
    assert losses == pytest.approx(reference_losses, abs=PARITY_TOLERANCE)
    exported = load_plain_model(root / "bert-zero1" / "final-hf", dtype=torch.float32).state_dict()
    worst = max((exported[k] - reference_state[k]).abs().max().item() for k in exported)
    print("max |Δweight| vs reference", worst)
    assert worst < PARITY_TOLERANCE
