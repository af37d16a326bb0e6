"""summary.txt: the layout in words, for the person about to launch it."""

from __future__ import annotations

from pathlib import PurePosixPath

from toolkit.generate.adjustments import Adjustment
from toolkit.generate.scripts import cpus_per_task
from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import RunLayout, padded_vocab_size
from toolkit.spec.schema import JobSpec
from toolkit.spec.lr_schedule import LrSchedule


# What the trainer does with edits to this directory's files (toolkit/train/job/run_files.py has the key tables).
EDIT_POLICY = (
    "edits      ds_config.json: tuning keys (bucket sizes, overlap_comm at pp 1, optimizer, monitors) may be edited",
    "           here; they win over the spec and are listed at start. Its batch, precision, ZeRO stage and offload",
    "           keys, a scheduler section, and all of megatron.json, must agree with the spec: change the spec and",
    "           regenerate instead.",
)


def _expert_lines(*, layout: RunLayout, shape: ModelShape) -> list[str]:
    if not shape.is_moe:
        return []
    return [f"experts    {shape.num_experts} per layer (top-{shape.moe_topk}), ep={layout.ep}: "
            f"{shape.num_experts // max(layout.ep, 1)} per rank, each replicated on expert-dp={layout.expert_dp} "
            "ranks (their gradients and ZeRO states there)"]


def render_summary(*, spec: JobSpec, layout: RunLayout, shape: ModelShape, run_dir: str,
                   adjustments: list[Adjustment]) -> str:
    """Layout, paths and the values the run files adjust (no check notes: those depend on this machine's files;
    `dsmt check` prints them)."""
    cluster, parallel, training = spec.cluster, spec.parallel, spec.training
    lines = [
        f"model      {shape.name}: {shape.num_params() / 1e6:,.1f} M params, {shape.num_layers} layers, "
        f"hidden {shape.hidden_size}, heads {shape.num_attention_heads} (kv {shape.num_kv_heads}), vocab {shape.vocab_size} "
        f"(padded {padded_vocab_size(vocab_size=shape.vocab_size, divisible_by=spec.model.make_vocab_size_divisible_by)})",
        f"cluster    {layout.nodes} node(s) x {layout.gpus_per_node} {cluster.gpu} = {layout.world_size} ranks; "
        f"device {cluster.device}, interconnect {cluster.interconnect}, launcher {cluster.launcher}",
        f"layout     tp={layout.tp}" + (f" x cp={layout.cp}" if layout.cp > 1 else "")
        + f" x pp={layout.pp} x dp={layout.dp} = {layout.world_size}"
        + (f", vpp={layout.vpp}" if layout.vpp > 1 else "")
        + (", sequence parallel" if parallel.sequence_parallel else ""),
        *_expert_lines(layout=layout, shape=shape),
        f"zero       stage {parallel.zero_stage}"
        + (", optimizer offloaded to CPU" if parallel.offload_optimizer else "")
        + (", params offloaded to CPU" if parallel.offload_params else ""),
        f"batch      global {layout.global_batch_size} sequences = micro {layout.micro_batch_size} x grad-accum "
        f"{layout.grad_accum_steps} x dp {layout.dp}; {layout.tokens_per_step} tokens/step at seq {layout.seq_length}",
        f"training   {training.train_steps} steps, {training.precision}, recompute {training.recompute}, lr {training.lr} "
        f"({training.lr_schedule}, warmup {training.warmup_steps}), checkpoint every {training.checkpoint_interval} steps",
        f"lr         {LrSchedule.from_training(training).describe()}; handed to deepspeed.initialize, so "
        "ds_config.json has no scheduler",
        *_path_lines(spec=spec, run_dir=run_dir),
        *_sbatch_lines(spec=spec, layout=layout),
        *_adjustment_lines(adjustments=adjustments),
        *EDIT_POLICY,
        "",
        "ranks (megatron order: tp fastest, then dp, then pp)",
        *_stage_lines(layout=layout),
        *_node_lines(layout=layout),
    ]
    return "\n".join(lines) + "\n"


def _path_lines(*, spec: JobSpec, run_dir: str) -> list[str]:
    """Where the files point: absolute paths are this machine's, which other nodes see only on a shared filesystem."""
    output_dir = spec.training.output_dir
    if PurePosixPath(output_dir).is_absolute():
        return [f"paths      run directory {run_dir}, output_dir {output_dir}",
                "           paths are absolute paths of the machine that generated this directory: the run directory",
                "           and output_dir must be at the same path on every node (a shared filesystem)"]
    # only render_all's own callers get here: dsmt generate and api.generate pin output_dir first
    return [f"paths      run directory {run_dir}: an absolute path of the machine that generated this directory, the",
            "           same on every node (a shared filesystem); output_dir " + output_dir + " is relative: the ranks",
            "           take it against the run directory (job.resolved.yaml's folder)"]


def _sbatch_lines(*, spec: JobSpec, layout: RunLayout) -> list[str]:
    """What job.sbatch asks SLURM for; it takes its nodes and rendezvous from the allocation, not cluster.hosts."""
    slurm = spec.cluster.slurm
    asks = [f"{name} {getattr(slurm, name)}" for name in ("account", "partition", "time", "qos")
            if getattr(slurm, name) is not None]
    asks.append(f"{cpus_per_task(spec=spec, layout=layout)} cores per node")
    extras = [f"{len(items)} {what}" for what, items in (("extra #SBATCH option(s)", slurm.extra_sbatch),
                                                          ("setup line(s)", slurm.setup),
                                                          ("srun argument(s)", slurm.srun_args)) if items]
    return [f"sbatch     job.sbatch asks for {', '.join(asks)}" + (f"; {', '.join(extras)}" if extras else "")
            + " (cluster.slurm); nodes and rendezvous come from the allocation"]


def _adjustment_lines(*, adjustments: list[Adjustment]) -> list[str]:
    """Each value the run files carry other than job.resolved.yaml (the spec as given) says, and why."""
    if not adjustments:
        return ["adjusted   none: the run files carry every spec value as job.resolved.yaml gives it"]
    return [f"adjusted   {len(adjustments)} value(s) differ from job.resolved.yaml (the spec as given):",
            *(f"           {adjustment.line()}" for adjustment in adjustments)]


def _stage_lines(*, layout: RunLayout) -> list[str]:
    per_stage = layout.tp * layout.dp
    return [f"  pipeline stage {stage}: ranks {stage * per_stage}-{(stage + 1) * per_stage - 1}"
            for stage in range(min(layout.pp, 16))] + (["  ..."] if layout.pp > 16 else [])


def _node_lines(*, layout: RunLayout) -> list[str]:
    g = layout.gpus_per_node
    return [f"  node {node}: ranks {node * g}-{(node + 1) * g - 1}" for node in range(min(layout.nodes, 16))] + (
        ["  ..."] if layout.nodes > 16 else [])
