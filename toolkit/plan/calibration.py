"""How sure the time model is: its error on the published measurements (toolkit/plan/published.py), the range
that error gives a prediction, and the published runs nearest a question.

A prediction's band is the RMS of log(predicted / measured) over the calibration rows of the same kind of
layout, those with sharded data-parallel traffic (ZeRO-2/3, FSDP: parameters or gradients sent every
micro-batch) or the rest (tensor, pipeline and ZeRO-0/1 data parallelism). Rows the model cannot reach within
CALIBRATION_TOLERANCE name the reason (PublishedRun.known_gap) and stay out of the band: they are listed, not
averaged away.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import Cluster, PlanLayout
from toolkit.plan.published import PublishedRun, calibration_runs, model_shape, predicted_utilisation
from toolkit.plan.units import time_unit
from toolkit.models.shapes import ModelShape

CALIBRATION_TOLERANCE = 0.20     # the bar: each measured row predicted within 20 %
KINDS = {"sharded": "sharded data parallel (ZeRO-2/3, FSDP)", "model": "tensor / pipeline parallel, ZeRO-0/1"}


def layout_kind(layout: PlanLayout) -> str:
    """'sharded' when data parallelism (the dp x cp ranks holding equal weights) sends parameters or gradients
    every micro-batch (ZeRO-2/3), else 'model'."""
    return "sharded" if layout.zero_stage >= 2 and layout.zero_size > 1 else "model"


def run_kind(run: PublishedRun) -> str:
    return layout_kind(run.layout())


@dataclasses.dataclass(frozen=True)
class Residual:
    run: PublishedRun
    predicted: float          # utilisation of the kind the source measured (MFU or HFU)

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.utilisation

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= CALIBRATION_TOLERANCE


@functools.lru_cache(maxsize=8)
def residuals(assumptions: Assumptions) -> tuple[Residual, ...]:
    """Every measured row with the model's prediction of it (interleaved runs of unpublished depth excluded)."""
    runs = [r for r in calibration_runs() if not r.interleaved_unpublished]
    return tuple(Residual(run=r, predicted=predicted_utilisation(r, assumptions=assumptions)) for r in runs)


@dataclasses.dataclass(frozen=True)
class Band:
    kind: str
    relative: float           # RMS of log(predicted / measured): the prediction is within exp(±relative)
    rows: int                 # measured rows it rests on
    gaps: int                 # rows of this kind outside CALIBRATION_TOLERANCE, with their reasons (not in `rows`)

    def range(self, value: float) -> tuple[float, float]:
        return value * math.exp(-self.relative), value * math.exp(self.relative)

    def describe(self) -> str:
        gaps = f"; {self.gaps} more with a named gap (dsmt plan --calibration)" if self.gaps else ""
        return f"±{self.relative:.0%}, the RMS error on {self.rows} measured {KINDS[self.kind]} runs{gaps}"


def band(*, kind: str, assumptions: Assumptions) -> Band:
    rows = [r for r in residuals(assumptions) if run_kind(r.run) == kind]
    kept = [r for r in rows if not r.run.known_gap]
    if not kept:
        return Band(kind=kind, relative=assumptions.time_uncertainty, rows=0, gaps=len(rows))
    rms = math.sqrt(sum(math.log(r.ratio) ** 2 for r in kept) / len(kept))
    return Band(kind=kind, relative=rms, rows=len(kept), gaps=len(rows) - len(kept))


def nearest_runs(*, shape: ModelShape, layout: PlanLayout, cluster: Cluster, assumptions: Assumptions,
                 count: int = 3) -> list[Residual]:
    """The measured rows nearest the question: same kind of layout first, then by model size, GPU count and GPU
    type (log distances, a different GPU type counts as a factor of e)."""
    kind = layout_kind(layout)
    params, gpus = shape.num_params(), cluster.world_size

    def distance(r: Residual) -> tuple:
        run = r.run
        return (run_kind(run) != kind,
                abs(math.log(model_shape(run.model).num_params() / params)) + abs(math.log(run.num_gpus / gpus))
                + (0.0 if run.gpu == cluster.gpu.name.rstrip("*") else 1.0))

    return sorted(residuals(assumptions), key=distance)[:count]


def calibration_rows(assumptions: Assumptions) -> list[dict]:
    """Every measured row as JSON: the run, measured and predicted utilisation, kind, and any named gap."""
    return [{"source": r.run.source, "run": r.run.label, "engine": r.run.engine, "model": r.run.model,
             "gpu": r.run.gpu, "num_gpus": r.run.num_gpus, "tp": r.run.tp, "pp": r.run.pp,
             "zero_stage": r.run.layout().zero_stage, "micro_batch_size": r.run.micro_batch_size,
             "recompute": r.run.layout().recompute, "kind": run_kind(r.run), "utilisation_kind": r.run.utilisation_kind,
             "measured": r.run.utilisation, "predicted": round(r.predicted, 4), "ratio": round(r.ratio, 4),
             "within_tolerance": r.within, "known_gap": r.run.known_gap or None, "note": r.run.note or None}
            for r in residuals(assumptions)]


def calibration_table(assumptions: Assumptions) -> list[str]:
    """Every measured row: measured and predicted utilisation, their ratio, and any named gap."""
    lines = [f"{'run':44s} {'layout':28s} {'kind':7s} {'measured':>8s} {'predicted':>9s} {'ratio':>6s}  note"]
    for r in residuals(assumptions):
        run, lay = r.run, r.run.layout()
        layout = f"tp{lay.tp} pp{lay.pp} dp{lay.dp} zero{lay.zero_stage} mbs{lay.micro_batch_size} {lay.recompute}"
        flag = "" if r.within else "OUTSIDE 20%: "
        lines.append(f"{run.label + ' ' + run.engine:44s} {layout:28s} {run_kind(run):7s} "
                     f"{run.utilisation:7.1%}{run.utilisation_kind[0]} {r.predicted:8.1%} {r.ratio:6.2f}  "
                     f"{flag}{run.known_gap or run.note}")
    return lines


def _run_line(near: dict) -> str:
    """One entry of how_sure's nearest_published as a line."""
    gap = f"; known gap: {near['known_gap']}" if near["known_gap"] else ""
    return (f"{near['run']} ({near['engine']}, tp{near['tp']} pp{near['pp']} zero{near['zero_stage']}): measured "
            f"{near['measured']:.1%} {near['kind'].upper()}, predicted {near['predicted']:.1%} "
            f"[{near['source']}]{gap}")


def how_sure(*, candidate, shape: ModelShape, cluster: Cluster, assumptions: Assumptions) -> dict:
    """The predicted range of a candidate's step time and MFU, and the published runs nearest it."""
    lay, t = candidate.layout, candidate.time
    b = band(kind=layout_kind(lay), assumptions=assumptions)
    low, high = b.range(t.step_time_s)
    near = nearest_runs(shape=shape, layout=lay, cluster=cluster, assumptions=assumptions)
    family = cluster.gpu.name.split("-")[0]
    same_gpu = sum(1 for r in residuals(assumptions) if run_kind(r.run) == b.kind and r.run.gpu.startswith(family))
    return {"kind": b.kind, "rows_on_this_gpu": same_gpu, "relative_uncertainty": round(b.relative, 4),
            "calibration_rows": b.rows, "rows_with_known_gaps": b.gaps, "band": b.describe(),
            "step_time_range_s": [float(f"{low:.4g}"), float(f"{high:.4g}")],  # digits that show a 0.1 ms step
            "mfu_range": [round(t.mfu * t.step_time_s / high, 4), round(t.mfu * t.step_time_s / low, 4)],
            "moe_uncalibrated": shape.is_moe,
            "nearest_published": [{"source": r.run.source, "run": r.run.label, "engine": r.run.engine,
                                   "tp": r.run.tp, "pp": r.run.pp, "zero_stage": r.run.layout().zero_stage,
                                   "measured": r.run.utilisation, "kind": r.run.utilisation_kind,
                                   "predicted": round(r.predicted, 4), "known_gap": r.run.known_gap or None}
                                  for r in near]}


def how_sure_lines(*, candidate, shape: ModelShape, cluster: Cluster, assumptions: Assumptions,
                   indent: str = "") -> list[str]:
    sure = how_sure(candidate=candidate, shape=shape, cluster=cluster, assumptions=assumptions)
    (low, high), (mfu_low, mfu_high) = sure["step_time_range_s"], sure["mfu_range"]
    caveats = [f"{indent}  no measured MoE run is in the calibration: expert all-to-all and routing imbalance are "
               "predicted, not fitted"] if sure["moe_uncalibrated"] else []
    if not sure["rows_on_this_gpu"]:
        caveats.append(f"{indent}  none of those runs was on {cluster.gpu.name}: the band is borrowed from other GPUs")
    step = candidate.time.step_time_s
    scale, unit = time_unit(step)  # s, or ms / µs for a small model's step
    return [f"{indent}how sure: step {step / scale:.2f} {unit}, likely {low / scale:.2f}-{high / scale:.2f} {unit} "
            f"(MFU {mfu_low:.1%}-{mfu_high:.1%}): {sure['band']}", *caveats,
            f"{indent}nearest published runs it is calibrated on:",
            *(f"{indent}  {_run_line(near)}" for near in sure["nearest_published"])]
