"""Resume at another layout (toolkit/train/checkpoint/reshard.py): a run checkpointed at one TP / PP / DP / ZeRO layout and
resumed at another continues the uninterrupted run's losses, with the model AND the optimizer state (fp32 master
weights, Adam moments and step, LR schedule, data position) resharded. An optimizer reset would show: at lr 3e-3
with warmup + cosine, fresh Adam moments change the next losses far beyond the bound.

A preempted run is simulated by cutting a finished one back to its step-2 checkpoint (the LR schedule depends on
train_steps, so the first part must be a 4-step run). One 4-rank launch runs every training of this file
(`_worker`):
    uninterrupted  dp4 ZeRO-1, 4 steps, checkpoints at 2 and 4
    tp2pp2         tp2 x pp2, the same 4 steps
    tp2pp2->dp4    a copy of `tp2pp2` cut back to step 2, resumed at dp4
    dp4->tp2pp2    a copy of `uninterrupted` cut back to step 2, resumed at tp2 x pp2
    zero1->zero3   a copy of `uninterrupted` cut back to step 2, resumed at dp4 ZeRO-3
    lora           LoRA at tp2 x dp2, 4 steps; then a copy cut back to step 2 resumed at dp4 ZeRO-2
    moe-lora       LoRA on a Qwen3-MoE (attention and routed experts) at tp2 x ep2, resumed at ep4
    refused        another global batch, another model: named errors, the checkpoint unchanged
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from toolkit.models.tiny import make_tiny_checkpoint
from train_helpers import cut_back, read_metrics, write_spec

pytestmark = pytest.mark.multiproc
HELPERS = Path(__file__).resolve().parents[1]  # tests/train: train_helpers
LOSS_BOUND = 1e-3  # the bound; fp32 across layouts differs by reduction order only (~1e-6 seen)
LORA = {"rank": 4, "alpha": 8}
TRAINING = {"lr_schedule": "cosine", "warmup_steps": 0, "lr": 3e-3, "min_lr": 3e-4, "grad_clip": 1.0}


def _spec(root: Path, name: str, *, out: str, steps: int, model: str = "model", global_batch: int = 8,
          lora: dict | None = None, ep: int = 1, **layout) -> str:
    training = {**TRAINING, "lora": lora} if lora else TRAINING
    parallel = {"ep": ep, "sequence_parallel": layout.get("tp", 1) > 1} if ep > 1 else {}
    return str(write_spec(root / f"{name}.yaml", model_dir=root / model, output_dir=root / out, steps=steps,
                          checkpoint_interval=2, global_batch=global_batch, micro=2, seq=32,
                          extra={"training": training, "parallel": parallel}, **layout))


@pytest.fixture(scope="module")
def resharded(tiny_llama, tmp_path_factory):
    from ranks import run_on_ranks

    root = tmp_path_factory.mktemp("reshard")
    shutil.copytree(tiny_llama, root / "model")
    make_tiny_checkpoint(root / "model-2-layers", num_hidden_layers=2)
    make_tiny_checkpoint(root / "moe", model_type="qwen3_moe", num_hidden_layers=2, seed=21)
    plan = [
        ("train", _spec(root, "uninterrupted", out="uninterrupted", steps=4, dp=4)),
        ("train", _spec(root, "a1", out="tp2pp2", steps=4, tp=2, pp=2, dp=1)),
        ("cut", str(root / "tp2pp2"), str(root / "tp2pp2-dp4"), 2),
        ("train", _spec(root, "a2", out="tp2pp2-dp4", steps=4, dp=4)),
        ("cut", str(root / "uninterrupted"), str(root / "dp4-tp2pp2"), 2),
        ("train", _spec(root, "b2", out="dp4-tp2pp2", steps=4, tp=2, pp=2, dp=1)),
        ("cut", str(root / "uninterrupted"), str(root / "zero1-zero3"), 2),
        ("train", _spec(root, "c2", out="zero1-zero3", steps=4, dp=4, zero=3)),
        # LoRA: only the adapters have optimizer state; the frozen base comes from the model, as in the first run
        ("train", _spec(root, "l1", out="lora", steps=4, tp=2, dp=2, lora=LORA)),
        ("cut", str(root / "lora"), str(root / "lora-dp4"), 2),
        ("train", _spec(root, "l2", out="lora-dp4", steps=4, dp=4, zero=2, lora=LORA)),
        # LoRA on a Qwen3-MoE's attention and routed experts at TP2 x EP2, resumed at EP4 (each rank one expert and
        # its adapters, TP1): the experts' adapters and their Adam moments resharded over EP and expert-TP
        ("train", _spec(root, "m1", out="moe-lora", steps=4, model="moe", tp=2, dp=2, ep=2, lora=LORA)),
        ("cut", str(root / "moe-lora"), str(root / "moe-lora-ep4"), 2),
        ("train", _spec(root, "m2", out="moe-lora-ep4", steps=4, model="moe", dp=4, ep=4, lora=LORA)),
        # bad input: another global batch, another model (4 layers -> 2); the checkpoint stays as it was
        ("cut", str(root / "uninterrupted"), str(root / "refused"), 2),
        ("hash", str(root / "refused" / "checkpoints" / "step_000002"), str(root / "before.json")),
        ("refused", _spec(root, "d1", out="refused", steps=4, tp=2, dp=2, global_batch=16),
         str(root / "refused-batch.txt")),
        ("refused", _spec(root, "d2", out="refused", steps=4, tp=2, dp=2, model="model-2-layers"),
         str(root / "refused-model.txt")),
        ("hash", str(root / "refused" / "checkpoints" / "step_000002"), str(root / "after.json")),
    ]
    (root / "plan.json").write_text(json.dumps(plan))
    result = run_on_ranks(__file__, root / "plan.json", nprocs=4, timeout=1200)
    return root, result.stdout + result.stderr


@pytest.mark.parametrize("run", ["tp2pp2", "tp2pp2-dp4", "dp4-tp2pp2", "zero1-zero3", "lora-dp4", "moe-lora-ep4"])
def test_resumed_losses_continue_the_uninterrupted_run(resharded, run):
    root, _ = resharded
    reference = read_metrics(root / {"lora-dp4": "lora", "moe-lora-ep4": "moe-lora"}.get(run, "uninterrupted"))
    resumed = read_metrics(root / run)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] == [m["step"] for m in reference]
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, reference)]
    print(f"\n{run}: |loss - uninterrupted| per step {['%.2e' % d for d in differences]}")
    assert max(differences) <= LOSS_BOUND
    for mine, theirs in zip(resumed[2:], reference[2:]):  # the LR schedule continues where it was
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
    if run == "moe-lora-ep4":  # the experts' adapters come out as the uninterrupted run's (measured: 2.8e-8)
        from safetensors.torch import load_file

        ours, theirs = (load_file(root / name / "final-hf-adapter" / "adapter_model.safetensors")
                        for name in (run, "moe-lora"))
        assert set(ours) == set(theirs) and any(".experts." in key for key in ours)
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6


def test_startup_line_names_both_layouts(resharded):
    _, output = resharded
    lines = [line for line in output.splitlines() if "resharded from" in line]
    assert any("resuming after step 2 (resharded from tp=2 pp=2 vpp=1 cp=1 dp=1 zero=1 (4 ranks) to tp=1 pp=1 "
               "vpp=1 cp=1 dp=4 zero=1 (4 ranks)" in line for line in lines), lines
    assert any("from tp=1 pp=1 vpp=1 cp=1 dp=4 zero=1 (4 ranks) to tp=1 pp=1 vpp=1 cp=1 dp=4 zero=3" in line
               for line in lines), lines


def test_the_resumed_checkpoint_is_not_modified(resharded):
    """The tag a resharding resume read is as it was written: its record of the writer's layout and each rank's
    share of the state."""
    root, _ = resharded
    tag = root / "tp2pp2-dp4" / "checkpoints" / "step_000002"
    record = json.loads((tag / "dsmt_layout.json").read_text())
    assert record["layout"]["tp"] == 2 and record["layout"]["pp"] == 2
    assert json.loads((tag / "dsmt_complete.json").read_text())["layout"] == record["layout"]
    # every rank wrote its own share (its ZeRO fragments): 4 files of about equal size, no DeepSpeed engine files
    files = sorted((tag / "state").glob("rank_*.safetensors"))
    assert [f.name for f in files] == [f"rank_{r:05d}.safetensors" for r in range(4)]
    sizes = [f.stat().st_size for f in files]
    assert min(sizes) > 0.2 * max(sizes) and (tag / "state" / "index.json").is_file()
    assert not list(tag.glob("*optim_states.pt")) and not list(tag.glob("*model_states.pt"))
    later = json.loads((root / "tp2pp2-dp4" / "checkpoints" / "step_000004" / "dsmt_complete.json").read_text())
    assert later["layout"]["dp"] == 4


def test_bad_input_is_refused_by_name_and_the_checkpoint_is_kept(resharded):
    root, _ = resharded
    batch = (root / "refused-batch.txt").read_text()
    assert "cannot be resumed by this run" in batch and "global batch 8 -> 16" in batch
    assert "keep training.global_batch_size=8" in batch
    model = (root / "refused-model.txt").read_text()
    assert "decoder.layers.self_attention.linear_qkv.weight: checkpoint shape [4, " in model
    assert "this run's [2, " in model and "resume with the spec that wrote it" in model
    before, after = (json.loads((root / name).read_text()) for name in ("before.json", "after.json"))
    assert before == after and len(before) > 10  # every file of the tag, by content


def _digests(directory: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _run_action(action: str, args: list) -> None:
    import torch.distributed as dist

    from toolkit.errors import DsmtError
    from toolkit.spec.load import load_spec
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.train.job.run import train

    if action in ("cut", "hash"):
        if dist.get_rank() == 0 and action == "cut":
            cut_back(Path(args[0]), Path(args[1]), to_step=args[2])
        if dist.get_rank() == 0 and action == "hash":
            Path(args[1]).write_text(json.dumps(_digests(Path(args[0]))))
        dist.barrier()
    elif action == "refused":  # every rank raises the same error (they read the same record)
        try:
            train(job=job_of(spec=load_spec(args[0]), report=Report(source=args[0], problems=())))
        except DsmtError as error:
            if dist.get_rank() == 0:
                Path(args[1]).write_text(str(error))
        else:
            raise AssertionError(f"{args[0]} resumed, but should have been refused")
    else:
        train(job=job_of(spec=load_spec(args[0]), report=Report(source=args[0], problems=())))


def _worker(plan_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo")
    for action, *args in json.loads(Path(plan_path).read_text()):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        _run_action(action, args)
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(HELPERS))
    _worker(sys.argv[1])
