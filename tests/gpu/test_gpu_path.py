"""The default path on a real cluster: CUDA + NCCL (+ Transformer Engine when installed). Skipped without CUDA."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_backend_is_cuda_nccl_and_installs_no_cpu_redirection():
    from toolkit import backend as backends
    from toolkit.backend import cpu

    backend = backends.current()
    assert (backend.name, backend.dist_backend, backend.batch_p2p_comm) == ("cuda", "nccl", True)
    assert not cpu.is_installed()


def test_verify_tp1_on_cuda(tmp_path):
    from toolkit.models.tiny import make_tiny_checkpoint
    from toolkit.verify.run import run_verify

    result = run_verify(checkpoint=make_tiny_checkpoint(tmp_path / "hf"), tp=1, pp=1)
    assert result["passed"], result


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
def test_verify_tp2_puts_each_rank_on_its_own_gpu(tmp_path):
    """Before ranks selected cuda:<LOCAL_RANK>, both TP ranks built their shard on cuda:0."""
    from toolkit.models.tiny import make_tiny_checkpoint
    from toolkit.verify.run import run_verify

    result = run_verify(checkpoint=make_tiny_checkpoint(tmp_path / "hf"), tp=2, pp=1)
    assert result["param_devices"] == ["cuda:0", "cuda:1"], result
    assert result["passed"], result


@two_gpus
def test_train_tp2_runs_a_few_steps_on_two_gpus(tmp_path):
    """`dsmt train` at TP2 (NCCL bound to each rank's device): finite losses, and the HF export loads."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from toolkit.models.tiny import make_tiny_checkpoint

    repo = Path(__file__).resolve().parents[2]
    spec = {
        "model": {"path": str(make_tiny_checkpoint(tmp_path / "hf"))},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "h100-80gb", "device": "cuda", "interconnect": "tcp"},
        "parallel": {"tp": 2, "pp": 1, "zero_stage": 1},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "precision": "bf16",
                     "train_steps": 3, "warmup_steps": 0, "checkpoint_interval": 3, "log_interval": 1,
                     "output_dir": str(tmp_path / "out")},
        "data": {"path": str(repo / "examples" / "data" / "tiny_stories.jsonl")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", "--config", str(tmp_path / "job.yaml")],
                          capture_output=True, text=True, cwd=repo, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in steps if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), steps


def _has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@two_gpus
@pytest.mark.skipif(not _has_transformer_engine(), reason="context parallelism needs Transformer Engine")
def test_context_parallel_cp2_matches_cp1(tmp_path):
    """CP2 (ring attention in Transformer Engine, the sequence split in 2·cp load-balanced chunks) trains to the
    same per-token losses as CP1 with DP2 on the same global batch: both see the same tokens per step."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from toolkit.models.tiny import make_tiny_checkpoint

    repo = Path(__file__).resolve().parents[2]
    hf = make_tiny_checkpoint(tmp_path / "hf")
    losses = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        spec = {
            "model": {"path": str(hf)},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "h100-80gb", "device": "cuda", "interconnect": "tcp"},
            "parallel": {"tp": 1, "pp": 1, "cp": cp, "zero_stage": 1},
            "training": {"global_batch_size": 4, "micro_batch_size": 2 if cp == 2 else 1, "seq_length": 64,
                         "precision": "bf16", "attention": "fused", "train_steps": 3, "warmup_steps": 0,
                         "checkpoint_interval": 3, "log_interval": 1, "grad_clip": 0, "output_dir": str(out)},
            "data": {"path": str(repo / "examples" / "data" / "tiny_stories.jsonl"), "shuffle": False},
        }
        (tmp_path / f"cp{cp}.yaml").write_text(yaml.safe_dump(spec))
        done = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", "--config", str(tmp_path / f"cp{cp}.yaml")],
                              capture_output=True, text=True, cwd=repo, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[cp] = [row["loss"] for row in rows if "loss" in row]
    assert len(losses[2]) == 3
    assert max(abs(a - b) for a, b in zip(losses[1], losses[2])) < 2e-2, losses  # bf16, different reduction order


def test_gpu_paths_no_cpu_test_runs(tmp_path):
    """scripts/gpu_cases.py on this GPU: verify under Transformer Engine, bf16 with packing, LoRA on TE layers
    (Llama, GPT-2), a plain model, MoE with its aux loss; one PASS / FAIL line per case."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_cases.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
