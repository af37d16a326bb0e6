"""Models without a megatron-core adapter train with DeepSpeed ZeRO data parallelism only (toolkit/train/plain/engine.py).

One 2-rank gloo launch runs every multi-process scenario (imports cost ~6 s per process):
  * synthetic inputs (PlainEngine + PlainBatches): a tiny ResNet at ZeRO-1 and ZeRO-3, a tiny DistilBERT masked LM
    at ZeRO-2;
  * real data through `toolkit.train.job.run.train` (the job spec, `_plain_parts`, DeepSpeed's config as dsmt writes
    it): a tiny ResNet on a 3-class folder of 24 PNGs at ZeRO-1 and ZeRO-2, a DistilBERT masked LM and a
    DistilBERT regression head (num_labels=1, MSE) on 20 jsonl records, a GPT-NeoX causal LM on 30 stories;
  * `data.synthetic: true` through the job spec (a ResNet at ZeRO-1);
  * the independent references of test_train_plain_references.py: the ResNet with torch DistributedDataParallel
    on the same ranks (no toolkit code); the text models in one process here, after the launch (the causal LM
    with tests/train/reference.py's data and loss rules);
  * torch.nn.SyncBatchNorm's forward on CPU tensors with gloo (refused by torch: dsmt refuses sync_batchnorm on CPU).

Measured (fp32, 4 steps of global batch 8 = DP2 x 2 micro-batches of 2, lr 1e-3 constant; torch 2.13 CPU,
DeepSpeed 0.19.8, transformers 5.24), max |difference| over the steps / over the exported state_dict:
  ResNet, image folder, vs torch DDP   ZeRO-1: loss 0.0, weights + BatchNorm buffers 0.0 (bit-identical)
                                       ZeRO-2: loss 1.2e-7, weights 1.2e-7
  DistilBERT masked LM vs 1 process    ZeRO-1: loss 4.8e-7, weights 3.4e-7
  DistilBERT regression (MSE)          ZeRO-2: loss 2.4e-7, weights 2.3e-8
  GPT-NeoX causal LM vs reference.py   ZeRO-1: loss 4.8e-7, weights 9.8e-7
Reproduce: .venv/bin/python -m pytest -s tests/train/plain/test_train_plain.py (one launch, ~35 s of ~45 s on 2 cores)
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.errors import DsmtError
from toolkit.train.plain.engine import (PLAIN_NOTICE, SyncBatchNormOnCpuError, check_plain_layout, convert_sync_batchnorm,
                                        is_plain_model, load_plain_model, plain_notice)
from toolkit.train.plain.synthetic import PlainBatches
from plain_helpers import distilbert, write_image_folder, write_text

REPO = Path(__file__).resolve().parents[3]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"
STEPS, MICRO, GRAD_ACCUM, DP = 3, 2, 2, 2
LR, SEED, SEQ = 1e-3, 11, 16
PARITY_TOLERANCE = 1e-5
REAL_STEPS = 4  # 24 images / 20 records at 8 per step: the last step(s) start a new epoch

# Synthetic scenarios (PlainEngine directly): model, ZeRO stage.
SYNTHETIC = {"resnet-zero1": ("resnet", 1), "resnet-zero3": ("resnet", 3), "mlm-zero2": ("mlm", 2)}
# Real-data scenarios (toolkit.train.job.run.train): model, ZeRO stage, data.
REAL = {"images-zero1": ("images", 1, "images"), "images-zero2": ("images", 2, "images"),
        "mlm-text": ("mlm", 1, "text"), "regression-text": ("regression", 2, "text"),
        "causal-text": ("causal", 1, "stories"), "resnet-synthetic": ("resnet", 1, "synthetic")}

WORKER = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from toolkit.spec.load import validate_spec
    from toolkit.train.plain.engine import PlainEngine, export_plain, load_plain_model, plain_notice
    from toolkit.train.plain.synthetic import PlainBatches
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.train.job.run import train

    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name, run in spec["synthetic"].items():
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
    for name, job in spec["real"].items():
        results[name] = train(job=job_of(spec=validate_spec(job, source=name), report=Report(source=name, problems=())))
        parallel_state.destroy_model_parallel()
    sys.path.insert(0, spec["tests_dir"])
    from test_train_plain_references import train_resnet_ddp

    results["ddp"] = train_resnet_ddp(spec=spec["real"]["images-zero1"], out_file=Path(spec["ddp_state"]))
    try:
        torch.nn.SyncBatchNorm(4).train()(torch.randn(2, 4, 3, 3))
        results["sync_batchnorm_cpu"] = "ran"
    except ValueError as err:
        results["sync_batchnorm_cpu"] = str(err)
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


def job_spec(*, model_dir: Path, data: dict, zero_stage: int, output_dir: Path) -> dict:
    """A 2-rank CPU fp32 job: constant lr (DeepSpeed's WarmupLR from lr to lr), no clipping, one parameter group."""
    return {"model": {"path": str(model_dir)},
            "cluster": {"nodes": 1, "gpus_per_node": DP, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "parallel": {"tp": 1, "pp": 1, "zero_stage": zero_stage},
            "training": {"global_batch_size": MICRO * GRAD_ACCUM * DP, "micro_batch_size": MICRO, "seq_length": SEQ,
                         "precision": "fp32", "lr": LR, "min_lr": LR, "lr_schedule": "constant", "warmup_steps": 0,
                         "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8,
                         "grad_clip": 0.0, "train_steps": REAL_STEPS, "checkpoint_interval": REAL_STEPS,
                         "log_interval": 1, "seed": SEED, "output_dir": str(output_dir)},
            "data": data}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import ResNetConfig, ResNetForImageClassification

    root = tmp_path_factory.mktemp("plain-models")
    torch.manual_seed(0)
    resnet = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                  num_labels=3)
    ResNetForImageClassification(ResNetConfig(**resnet)).save_pretrained(root / "resnet")
    ResNetForImageClassification(ResNetConfig(**resnet, image_size=32)).save_pretrained(root / "images")
    return {"resnet": root / "resnet", "images": root / "images", "mlm": distilbert(root / "mlm", head="MaskedLM"),
            "regression": distilbert(root / "regression", head="SequenceClassification", num_labels=1),
            "causal": tiny_gpt_neox(root / "causal")}


def tiny_gpt_neox(root: Path) -> Path:
    """A causal LM without an adapter (GPT-NeoX) with the tiny character tokenizer of toolkit/models/tiny.py."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from toolkit.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(root)  # for its tokenizer files; the model is replaced below
    vocab_size = json.loads((root / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)).save_pretrained(root)
    return root


def first_records(source: Path, target: Path, *, count: int) -> Path:
    target.write_text("".join(source.read_text().splitlines(keepends=True)[:count]))
    return target


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory) -> tuple[dict, Path, dict]:
    """Every scenario, trained in one 2-rank launch; returns (per-scenario results, output root, real job specs)."""
    from ranks import run_on_ranks

    root = tmp_path_factory.mktemp("plain-runs")
    data = {"images": {"path": str(write_image_folder(root / "images"))},
            "text": {"path": str(write_text(root / "text.jsonl")), "label_field": "score"},
            "stories": {"path": str(first_records(STORIES, root / "stories.jsonl", count=30))},
            "synthetic": {"synthetic": True}}
    synthetic = {name: {"model_dir": str(models[model]), "ds_config": ds_config(zero_stage=stage),
                        "out_dir": str(root / name / "final-hf")} for name, (model, stage) in SYNTHETIC.items()}
    real = {name: job_spec(model_dir=models[model], data=data[source], zero_stage=stage, output_dir=root / name)
            for name, (model, stage, source) in REAL.items()}
    real["causal-text"]["training"]["export_hf_interval"] = REAL_STEPS  # its last checkpoint holds hf/
    spec = {"synthetic": synthetic, "real": real, "steps": STEPS, "micro": MICRO, "grad_accum": GRAD_ACCUM,
            "seed": SEED, "seq": SEQ, "results": str(root / "results.json"), "ddp_state": str(root / "ddp.pt"),
            "tests_dir": str(Path(__file__).parent)}
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "worker.py").write_text(WORKER)
    run_on_ranks(root / "worker.py", root / "spec.json", nprocs=DP, timeout=600)  # conftest set TORCH_EXTENSIONS_DIR
    return json.loads((root / "results.json").read_text()), root, real


# ---- pure unit tests -------------------------------------------------------------------------------------------

def test_plain_models_are_those_without_an_adapter(models, tmp_path):
    assert is_plain_model(models["resnet"]) and is_plain_model(models["mlm"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_plain_model(tmp_path)


def test_layout_with_tp_or_pp_is_refused_with_the_rule():
    check_plain_layout(tp=1, pp=1)
    with pytest.raises(DsmtError) as err:
        check_plain_layout(tp=2, pp=1, model_type="resnet")
    message = str(err.value)
    assert "model_type resnet has no megatron-core adapter" in message
    assert "set parallel.tp=1 and parallel.pp=1" in message and "tp=2, pp=1" in message
    assert "llama" in message.split("adapters exist for: ")[1]
    with pytest.raises(DsmtError, match="pp=2"):
        check_plain_layout(tp=1, pp=2)


def test_notice_text():
    assert plain_notice(model_type="bert", zero_stage=2) == PLAIN_NOTICE.format(model_type="bert", stage=2) == (
        "model_type bert has no megatron-core adapter: training with DeepSpeed ZeRO-2 data parallelism only "
        "(tp=1, pp=1)")


def test_load_picks_the_class_named_in_config(models, tmp_path):
    assert type(load_plain_model(models["resnet"], dtype=torch.float32)).__name__ == "ResNetForImageClassification"
    assert type(load_plain_model(models["mlm"], dtype=torch.bfloat16)).__name__ == "DistilBertForMaskedLM"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet", "architectures": ["NoSuchModel"]}))
    with pytest.raises(DsmtError, match="AutoModelForCausalLM cannot load it"):
        load_plain_model(tmp_path, dtype=torch.float32)


def test_sync_batchnorm_is_refused_on_cpu_and_converts_otherwise(models):
    model = load_plain_model(models["resnet"], dtype=torch.float32)
    with pytest.raises(SyncBatchNormOnCpuError, match="sync_batchnorm=true with cluster.device=cpu"):
        convert_sync_batchnorm(model, device="cpu")
    converted = convert_sync_batchnorm(model, device="cuda")  # conversion itself needs no GPU
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in converted.modules())
    assert not any(type(m) is torch.nn.BatchNorm2d for m in converted.modules())


@pytest.mark.parametrize("model", ["resnet", "mlm"])
def test_synthetic_batches_are_deterministic_disjoint_rank_slices_of_the_global_batch(models, model):
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
    if model == "resnet":
        assert expected["pixel_values"].shape == (MICRO * GRAD_ACCUM * DP, 3, 32, 32)
        assert expected["labels"].dtype == torch.int64 and int(expected["labels"].max()) < 3
    else:
        masked = expected["labels"] != -100
        assert masked.any(dim=1).all() and 0.05 < masked.float().mean() < 0.4


# ---- multi-process: one launch, several checks -----------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_synthetic_trains_at_dp2_and_exports_a_loadable_changed_model(name, trained, models):
    results, root, _ = trained
    run = results[name]
    model, stage = SYNTHETIC[name]
    print(name, "losses", run["loss"], "grad norms", run["grad_norm"])
    assert all(torch.isfinite(torch.tensor(run["loss"])))
    assert len(set(run["loss"])) == STEPS  # every step trains on new batches with new weights
    assert run["lr"] == [LR] * STEPS
    assert run["notice"] == plain_notice(model_type=load_plain_model(models[model], dtype=torch.float32)
                                         .config.model_type, zero_stage=stage)
    exported = load_plain_model(root / name / "final-hf", dtype=torch.float32).state_dict()
    start = load_plain_model(models[model], dtype=torch.float32).state_dict()
    assert sorted(exported) == sorted(start)
    moved = max((exported[k].float() - start[k].float()).abs().max().item() for k in exported)
    assert moved > 1e-4


@pytest.mark.multiproc
def test_zero_stages_train_alike(trained):
    results, _, _ = trained
    assert results["resnet-zero3"]["loss"] == pytest.approx(results["resnet-zero1"]["loss"], abs=PARITY_TOLERANCE)


def exported_state(output_dir: Path) -> dict[str, torch.Tensor]:
    """The exported model's state_dict as transformers loads it (its checkpoint names may be older ones)."""
    return load_plain_model(output_dir / "final-hf", dtype=torch.float32).state_dict()


def max_weight_diff(exported: dict, reference: dict, *, floats_only: bool = False) -> float:
    assert set(exported) <= set(reference) and len(exported) > 0
    keys = [k for k in exported if exported[k].is_floating_point() or not floats_only]
    return max((exported[k].double() - reference[k].double()).abs().max().item() for k in keys)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["images-zero1", "images-zero2"])
def test_resnet_on_an_image_folder_matches_torch_ddp(name, trained, models):
    """Per-step loss and the exported weights + BatchNorm buffers against DistributedDataParallel (rank 0)."""
    results, root, _ = trained
    losses = [record["loss"] for record in results[name]]
    print(f"{name} dsmt {losses}\n{'':>12} ddp  {results['ddp']}")
    assert [record["lr"] for record in results[name]] == [LR] * REAL_STEPS
    assert losses == pytest.approx(results["ddp"], abs=PARITY_TOLERANCE)
    exported = exported_state(root / name)
    start = load_plain_model(models["images"], dtype=torch.float32).state_dict()
    reference = torch.load(root / "ddp.pt")
    worst = max_weight_diff(exported, reference)  # BatchNorm's num_batches_tracked included
    moved = max_weight_diff(exported, start, floats_only=True)
    loss_diff = max(abs(a - b) for a, b in zip(losses, results["ddp"]))
    print(f"{name} max |Δloss| {loss_diff:.2e}, max |Δweight| vs DDP {worst:.2e}, moved {moved:.2e}")
    assert worst < PARITY_TOLERANCE and moved > 1e-3
    assert results["ddp"][-1] < results["ddp"][0]  # it learns


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["mlm-text", "regression-text", "causal-text"])
def test_text_models_on_jsonl_match_a_one_process_reference(name, trained):
    from test_train_plain_references import train_causal_reference, train_text_reference

    results, root, real = trained
    losses = [record["loss"] for record in results[name]]
    reference = train_causal_reference if name == "causal-text" else train_text_reference
    reference_losses, reference_state = reference(spec=real[name])
    print(f"{name} dsmt {losses}\n{'':>15} ref  {reference_losses}")
    assert losses == pytest.approx(reference_losses, abs=PARITY_TOLERANCE)
    worst = max_weight_diff(exported_state(root / name), reference_state)
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
    print(f"{name} max |Δloss| {loss_diff:.2e}, max |Δweight| vs reference {worst:.2e}")
    assert worst < PARITY_TOLERANCE


@pytest.mark.multiproc
def test_export_hf_interval_puts_the_model_in_its_checkpoint(trained):
    """training.export_hf_interval: the checkpoint of the last step holds hf/, the model as transformers loads it
    (the final export's weights) with the source's tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, root, _ = trained
    hf = root / "causal-text" / "checkpoints" / f"step_{REAL_STEPS:06d}" / "hf"
    state = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    final = exported_state(root / "causal-text")
    assert sorted(state) == sorted(final) and all(torch.equal(state[k], final[k]) for k in state)
    AutoTokenizer.from_pretrained(hf)
    assert not (root / "mlm-text" / "checkpoints" / f"step_{REAL_STEPS:06d}" / "hf").exists()  # no interval, no hf/


@pytest.mark.multiproc
def test_synthetic_inputs_through_the_job_spec_train_and_export(trained):
    """`data.synthetic: true` for a plain model: `_plain_parts` feeds PlainBatches; metrics and final-hf written."""
    from transformers import AutoModelForImageClassification

    results, root, _ = trained
    history = results["resnet-synthetic"]
    assert [r["step"] for r in history] == list(range(1, REAL_STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in history) and len({r["loss"] for r in history}) == REAL_STEPS
    metrics = [json.loads(line) for line in (root / "resnet-synthetic" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [r["loss"] for r in history]
    AutoModelForImageClassification.from_pretrained(root / "resnet-synthetic" / "final-hf")


@pytest.mark.multiproc
def test_torch_sync_batchnorm_does_not_run_on_cpu(trained):
    """Why dsmt refuses training.sync_batchnorm on CPU: torch itself does (if this changes, allow it)."""
    results, _, _ = trained
    assert "SyncBatchNorm expected input tensor to be on GPU" in results["sync_batchnorm_cpu"]
