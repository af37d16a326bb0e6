"""Specs the generator tests render: the ready configs plus variants that reach the other branches."""

from __future__ import annotations

from pathlib import Path

import yaml

from toolkit.generate.writer import render_all

from toolkit.check.job import check_job
from toolkit.spec.load import validate_spec

REPO = Path(__file__).parents[2]
GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_RUN_DIR = "/RUN_DIR"  # job.sbatch bakes the run directory in
SCRIPTS = ("launch_deepspeed.sh", "launch_torchrun.sh", "job.sbatch")

_TINY = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())


def _gpu_variant(**sections) -> dict:
    raw = {"model": {"builtin": "llama3-8b"},
           "cluster": {"nodes": 2, "gpus_per_node": 8, "hosts": ["gpu-a.cluster.local", "gpu-b.cluster.local"]},
           "training": {"global_batch_size": 128, "micro_batch_size": 2, "seq_length": 2048},
           "data": {"synthetic": True}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


VARIANTS: dict[str, dict] = {
    **{path.stem: yaml.safe_load(path.read_text()) for path in sorted((REPO / "configs").glob("*.yaml"))},
    "no-ssh-2x8-tcp": _gpu_variant(cluster={"launcher": "no_ssh", "interconnect": "tcp", "network_interface": "eth0"},
                                   parallel={"tp": 8, "pp": 2}, training={"recompute": "full", "lr_schedule": "constant"}),
    "openmpi-zero3-offload-fp16": _gpu_variant(
        cluster={"launcher": "openmpi", "master_addr": "10.0.0.1"},
        parallel={"tp": 2, "zero_stage": 3, "offload_optimizer": True, "offload_params": True},
        training={"precision": "fp16", "lr_schedule": "linear", "warmup_steps": 0},
        communication={"extra_env": {"NCCL_ALGO": "Ring"}, "communication_data_type": "fp32"}),
    # Mixture of experts: 8 experts split over ep=4 of the 4 data-parallel replicas (expert-dp 1), TP with SP.
    "mixtral-8x7b-ep4": _gpu_variant(model={"builtin": "mixtral-8x7b"}, parallel={"tp": 2, "pp": 2, "ep": 4,
                                     "sequence_parallel": True}, training={"global_batch_size": 64, "micro_batch_size": 1}),
    # DeepSeek-V2-Lite (multi-latent attention, a dense first layer, shared experts): MLA's fields and the per-layer
    # MoE pattern in megatron.json; 27 layers, so pp 1.
    "deepseek-v2-lite-ep4": _gpu_variant(model={"builtin": "deepseek-v2-lite"}, parallel={"tp": 2, "ep": 4,
                                         "sequence_parallel": True}, training={"global_batch_size": 64,
                                                                               "micro_batch_size": 1}),
    # One node through mpirun (tests/launch/test_mpi_real.py trains it): DeepSpeed's OpenMPI runner, no ssh.
    "openmpi-1x2-cpu": {**_TINY, "cluster": {**_TINY["cluster"], "launcher": "openmpi"}},
    # DeepSpeed's wandb monitor: entity is DeepSpeed's `team`, the run name reaches W&B as WANDB_NAME (not here).
    "tiny-cpu-wandb": {**_TINY, "training": {**_TINY["training"], "wandb": {
        "project": "dsmt-test", "name": "tiny", "entity": "my-team", "group": "sweep-1"}}},
    # Every cluster.slurm extra, with the characters sbatch's directive parser treats specially (blanks, '#', '&').
    "slurm-site-extras": _gpu_variant(parallel={"tp": 8}, cluster={"hosts": "slurm", "slurm": {
        "account": "ml research", "partition": "gpu,gpu-long", "time": "2-12:00:00", "qos": "high",
        "extra_sbatch": ["--exclusive", "--constraint=a100&ib", "--comment=dsmt run #1"],
        "setup": ["module load cuda/12.4", "source /opt/venv/bin/activate", 'echo "setup done on $(hostname)"'],
        "srun_args": ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3", "--container-mounts=/data:/data"]}}),
    # A SLURM site's pp=2 job (issue 46): account, partition, time, qos and environment set-up in job.sbatch, and
    # summary.txt's adjustments (overlap_comm off at pp > 1; overlap_p2p_comm without vpp; master_addr under SLURM).
    "slurm-pp2-site": _gpu_variant(
        parallel={"tp": 4, "pp": 2}, communication={"overlap_p2p_comm": True},
        training={"output_dir": "/shared/runs/llama3-8b-pp2"},  # absolute, as dsmt generate writes it
        cluster={"hosts": "slurm", "master_addr": "10.0.0.1", "slurm": {
            "account": "proj42", "partition": "gpu", "time": "1-00:00:00", "qos": "normal",
            "setup": ["module load cuda/12.4", 'source "$HOME/venvs/dsmt/bin/activate"']}}),
}


def spec_of(name: str):
    return validate_spec(VARIANTS[name], source=name)


def render(name: str, *, run_dir: str = GOLDEN_RUN_DIR, train_module: str = "toolkit.train") -> dict[str, str]:
    return render_all(job=check_job(spec_of(name)), run_dir=run_dir, train_module=train_module)


def fake_launchers(bin_dir: Path) -> None:
    """deepspeed / torchrun / pdsh / mpirun stand-ins that print their name and arguments one per line, then the
    exported NCCL/DS environment."""
    bin_dir.mkdir()
    for name in ("deepspeed", "torchrun", "pdsh", "mpirun"):
        (bin_dir / name).write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@"\n'
                                    'env | grep -E "^(NCCL_|DS_|OMP_|GLOO_)" | sort\n')
        (bin_dir / name).chmod(0o755)
