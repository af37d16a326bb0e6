"""summary.txt: the layout in words, for the person about to launch it."""

from __future__ import annotations

from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import RunLayout, padded_vocab_size
from toolkit.spec.schema import JobSpec


# What the trainer does with edits to this directory's files (toolkit/train/job/run_files.py has the key tables).
EDIT_POLICY = (
    "edits      ds_config.json: tuning keys (bucket sizes, overlap_comm, optimizer, scheduler, monitors) may be edited",
    "           here; they win over the spec and are listed at start. Its batch, precision, ZeRO stage and offload",
    "           keys, and all of megatron.json, must agree with the spec: change the spec and regenerate instead.",
)


def _expert_lines(*, layout: RunLayout, shape: ModelShape) -> list[str]:
    if not shape.is_moe:
        return []
    return [f"experts    {shape.num_experts} per layer (top-{shape.moe_topk}), ep={layout.ep}: "
            f"{shape.num_experts // max(layout.ep, 1)} per rank, each replicated on expert-dp={layout.expert_dp} "
            "ranks (their gradients and ZeRO states there)"]


def render_summary(*, spec: JobSpec, layout: RunLayout, shape: ModelShape) -> str:
    """Layout only (no check notes: those depend on this machine's files; `dsmt check` prints them)."""
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
        *EDIT_POLICY,
        "",
        "ranks (megatron order: tp fastest, then dp, then pp)",
        *_stage_lines(layout=layout),
        *_node_lines(layout=layout),
    ]
    return "\n".join(lines) + "\n"


def _stage_lines(*, layout: RunLayout) -> list[str]:
    per_stage = layout.tp * layout.dp
    return [f"  pipeline stage {stage}: ranks {stage * per_stage}-{(stage + 1) * per_stage - 1}"
            for stage in range(min(layout.pp, 16))] + (["  ..."] if layout.pp > 16 else [])


def _node_lines(*, layout: RunLayout) -> list[str]:
    g = layout.gpus_per_node
    return [f"  node {node}: ranks {node * g}-{(node + 1) * g - 1}" for node in range(min(layout.nodes, 16))] + (
        ["  ..."] if layout.nodes > 16 else [])
