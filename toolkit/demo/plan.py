"""The planner's view of the demo's training layout, on a GPU cluster it names. The planner models GPUs (matmul
throughput, HBM, NVLink); the demo trains on 4 CPU processes, which it does not model. So the pictures and
plan.txt put the demo's model, batch, precision and layout on PLAN_GPU x the demo's 4 ranks, and their titles and
first lines say so: no figure there is the CPU run's (train/metrics.jsonl has those)."""

from __future__ import annotations

from pathlib import Path

PLAN_GPU = "h100-80gb"


def plan_pictures(*, spec, model_dir: Path, out_dir: Path) -> list[tuple[Path, str]]:
    """The planner's memory and pipeline pictures of the spec's own layout (not a searched one) on PLAN_GPU, and
    plan.txt: what the planner was asked and why, then its `--explain` of that layout, which ends with where the
    layout ranks among all that fit and the step-time terms that put it there. Returns (path, what it is)."""
    from toolkit.adapters.model_shape import load_model_shape
    from toolkit.plan.charts import draw_charts
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Cluster
    from toolkit.plan.search import evaluate, plan
    from toolkit.check.checks import planner_inputs

    layout, training, _, assumptions = planner_inputs(spec)
    cluster = Cluster(nodes=spec.cluster.nodes, gpus_per_node=spec.cluster.gpus_per_node, gpu=get_gpu(PLAN_GPU))
    shape = load_model_shape(model_dir)
    candidate = evaluate(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=assumptions)
    # the whole search too, so that plan.txt can say where the demo's layout ranks among all valid ones
    result = plan(shape=shape, training=training, cluster=cluster, assumptions=assumptions)
    where = cluster_name(cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    note = f"planned for {where} (GPUs); the demo's own run is on {cluster.world_size} CPU processes"
    charts = [p for p in draw_charts(result=result, candidate=candidate, out_dir=out_dir, note=note)
              if p.suffix == ".png"]
    text = out_dir / "plan.txt"
    text.write_text(plan_text(shape=shape, layout=layout, training=training, cluster=cluster, result=result))
    described = {"memory": f"the planner's memory per GPU by stage and kind for {layout.label()} on {where} "
                           "(a GPU cluster, not this CPU run)",
                 "pipeline": "its pipeline schedule (1F1B) with the predicted step time on those GPUs"}
    return [(p, described.get(p.stem, "a planner chart")) for p in charts] + [
        (text, f"`dsmt plan --explain` of that layout on {where}: memory, time, its rank and why")]


def cluster_name(cluster) -> str:
    return f"{cluster.nodes} node x {cluster.gpus_per_node} {cluster.gpu.name}"


def plan_text(*, shape, layout, training, cluster, result) -> str:
    """plan.txt: the preamble, then `dsmt plan --explain` of the demo's layout (`result`: the whole search)."""
    from toolkit.plan.report import explain

    lines = preamble(layout=layout, choice=result.best, where=cluster_name(cluster))
    explained = explain(shape=shape, layout=layout, training=training, cluster=cluster, result=result)
    return "\n".join(lines) + "\n\n" + explained + "\n"


def preamble(*, layout, choice, where: str) -> list[str]:
    """plan.txt's first lines: which cluster this is, that it is not the CPU run, and why the demo trains a layout
    the planner may rank below its choice (`choice`: the search's best candidate, None when nothing fits)."""
    lines = [f"dsmt demo: the planner's prediction for the demo's model, batch and layout on {where}, not the CPU run.",
             "The planner models GPUs; the demo trains on CPU processes (gloo), which it does not model, so no figure",
             "below is the CPU run's (train/metrics.jsonl has those)."]
    if choice is None or choice.layout == layout:
        return lines + ["The demo's layout is the one the planner chooses for this cluster."]
    return lines + [f"The demo trains {layout.label()} to show pipeline parallelism and ZeRO-1 across",
                    f"data-parallel ranks. For a model this small the planner chooses {choice.layout.label()}:",
                    "the last lines say where the demo's layout ranks and which terms of the step put it there."]


def console_lines(plan_txt: str) -> list[str]:
    """What the console shows of plan.txt: the cluster it was planned for and the explained layout's rank and why."""
    lines = plan_txt.splitlines()
    ranked = [line for line in lines if line.startswith(("  rank ", "  why: ", "  this is the planner's choice"))]
    return [f"  {lines[0].removeprefix('dsmt demo: ')}", *ranked]
