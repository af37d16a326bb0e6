"""Charts of the chosen layout: memory per GPU by stage and category, and its pipeline schedule timeline.

matplotlib is imported inside the functions (Agg backend) so that `dsmt plan` stays cheap to import.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.plan.layout import num_micro_batches
from toolkit.plan.memory import stage_memory
from toolkit.plan.schedule import simulate_pipeline
from toolkit.plan.search import Candidate, Plan
from toolkit.plan.units import time_unit

COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer": "#c44e52", "activations": "#dd8452",
          "buffers": "#8172b3", "overhead": "#999999", "reference": "#937860"}
MAX_STAGES_DRAWN = 32
MAX_MICRO_DRAWN = 16


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stages_drawn(pp: int) -> list[int]:
    if pp <= MAX_STAGES_DRAWN:
        return list(range(pp))
    step = -(-pp // MAX_STAGES_DRAWN)
    return sorted(set(range(0, pp, step)) | {pp - 1})


def memory_chart(*, result: Plan, candidate: Candidate, out_dir: Path, note: str = "") -> list[Path]:
    """`note`: a last title line (the demo's: which cluster this is, and that it is not the CPU run)."""
    plt = _pyplot()
    lay = candidate.layout
    stages = [stage_memory(shape=result.shape, layout=lay, training=result.training, stage=s,
                           assumptions=result.assumptions) for s in _stages_drawn(lay.pp)]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.45 * len(stages) + 5), 5))
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for cat in stages[0].by_category():  # CATEGORIES, and DPO's reference weights where a copy is held
        values = [getattr(s, cat) / 1e9 for s in stages]
        ax.bar(xs, values, bottom=bottom, color=COLORS[cat], label=cat, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    capacity = candidate.memory.capacity_bytes / 1e9
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(-0.45, capacity, f"{result.cluster.gpu.name} capacity {capacity:.1f} GB", va="bottom", ha="left",
            fontsize=8)
    for x, total in zip(xs, bottom):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [str(s.stage) for s in stages])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_ylim(0, max(capacity, max(bottom)) * 1.15)
    ax.set_title(f"{result.shape.name} on {result.cluster.world_size} x {result.cluster.gpu.name}: memory per GPU"
                 f"\n{lay.label()}" + (f"\n{note}" if note else ""), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, out_dir / "memory")


def pipeline_chart(*, result: Plan, candidate: Candidate, out_dir: Path, note: str = "") -> list[Path]:
    """Timeline of one step's schedule; at most MAX_MICRO_DRAWN micro-batches are drawn (said in the title). Time
    is in the step's unit (s, or ms / µs for a small model); `note` as in memory_chart."""
    plt = _pyplot()
    lay, t = candidate.layout, candidate.time
    m = num_micro_batches(layout=lay, training=result.training)
    drawn = min(m, max(MAX_MICRO_DRAWN, lay.pp))
    if lay.vpp > 1:
        drawn = max(lay.pp, drawn // lay.pp * lay.pp)
    scale, unit = time_unit(t.step_time_s)
    per_mb = (t.step_time_s - t.dp_comm_s - t.optimizer_s - t.bubble_s - t.reference_s) / m / scale  # forward + backward, in `unit`
    ops = simulate_pipeline(pp=lay.pp, vpp=lay.vpp, num_micro=drawn, forward_s=per_mb / 3,
                            backward_s=2 * per_mb / 3)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, max(2.5, 0.35 * lay.pp + 1.5)))
    for op in ops:
        shade = cmap(2 * (op.micro_batch % 10) + (1 if op.kind == "F" else 0))  # tab20 pairs: dark, light
        ax.broken_barh([(op.start, op.end - op.start)], (op.stage - 0.4, 0.8), facecolors=shade,
                       edgecolors="white", linewidth=0.3)
        if 2 * drawn * lay.vpp <= 32:  # labels only while the boxes are wide enough to read
            label = f"{op.kind}{op.micro_batch}" + (f".{op.chunk}" if lay.vpp > 1 else "")
            ax.text((op.start + op.end) / 2, op.stage, label, ha="center", va="center", fontsize=6)
    makespan = max(op.end for op in ops)
    ax.set_yticks(range(lay.pp), [f"stage {s}" for s in range(lay.pp)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})  -  light: forward, dark: backward"
                  + ("; label F<mb>.<chunk>" if lay.vpp > 1 else ""))
    busy = sum(op.end - op.start for op in ops) / (lay.pp * makespan)
    ax.set_title(pipeline_title(pp=lay.pp, vpp=lay.vpp, num_micro=m, drawn=drawn, bubble_fraction=t.bubble_fraction,
                                drawn_idle_share=1 - busy) + (f"\n{note}" if note else ""), fontsize=10)
    ax.set_xlim(0, makespan)
    fig.tight_layout()
    return _save(fig, plt, out_dir / "pipeline")


def pipeline_title(*, pp: int, vpp: int, num_micro: int, drawn: int, bubble_fraction: float,
                   drawn_idle_share: float) -> str:
    """The pipeline chart's title: the planner's bubble figure for the step, worded as plan.txt words it, and,
    labelled apart, the idle share of the drawn timeline.

    Both count the same idle time, (p-1)/v micro-batch slots per stage, but divide it by different things:
    plan.txt's bubble (p-1)/(v*m) (Narayanan et al. 2021, section 2.2) divides it by the busy time m; the
    drawing's idle share divides it by the whole drawn span, m + (p-1)/v, so it is (p-1)/(v*m + p-1) (the
    demo's pp=2, m=2: 50% against 33.3%). When only some micro-batches are drawn, the same fill and drain is set
    against fewer of them and the drawn share is larger than the step's."""
    shown = f"{drawn} of {num_micro} micro-batches shown" if drawn < num_micro else f"{num_micro} micro-batches"
    return (f"1F1B{' interleaved' if vpp > 1 else ''} schedule, pp={pp} vpp={vpp}, {shown}\n"
            f"bubble (p-1)/(v*m) = {bubble_fraction:.1%} of the step's busy time (as plan.txt); "
            f"drawn: stages idle {drawn_idle_share:.1%} of the timeline")


def _save(fig, plt, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=130)
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def draw_charts(*, result: Plan, candidate: Candidate, out_dir: Path, note: str = "") -> list[Path]:
    out_dir = Path(out_dir)
    return memory_chart(result=result, candidate=candidate, out_dir=out_dir, note=note) + pipeline_chart(
        result=result, candidate=candidate, out_dir=out_dir, note=note)
