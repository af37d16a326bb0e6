"""What `dsmt demo` tells the user: a command their shell can run (bare `dsmt` only when PATH finds this install),
a pipeline picture whose bubble figure is plan.txt's, and a plan that names its GPU cluster, shows the tiny model's
figures in units that show them and says why the demo's layout ranks where it does (toolkit/demo/files.py,
toolkit/demo/plan.py, toolkit/plan/charts.py)."""

import re

import pytest

from toolkit.demo.files import DemoFiles, dsmt_command


@pytest.fixture
def venv(tmp_path):
    """A venv's bin/: python a link to a base interpreter elsewhere (as `python3 -m venv` makes it), dsmt a file."""
    base = tmp_path / "base" / "bin"
    base.mkdir(parents=True)
    (base / "python3").write_text("")
    bin_dir = tmp_path / "repo" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(base / "python3")
    (bin_dir / "dsmt").write_text("#!python\n")
    return bin_dir


def test_bare_dsmt_when_path_finds_this_install(venv, tmp_path):
    assert dsmt_command(on_path=str(venv / "dsmt"), executable=str(venv / "python"), argv0=str(venv / "dsmt")) == "dsmt"
    linked = tmp_path / "local-bin" / "dsmt"  # e.g. ~/.local/bin/dsmt -> the venv's
    linked.parent.mkdir()
    linked.symlink_to(venv / "dsmt")
    assert dsmt_command(on_path=str(linked), executable=str(venv / "python"), argv0=str(venv / "dsmt")) == "dsmt"


@pytest.mark.parametrize("elsewhere", [None, "other"])
def test_the_absolute_path_when_path_finds_none_or_another(venv, tmp_path, monkeypatch, elsewhere):
    """The README's `bash scripts/bootstrap.sh && .venv/bin/dsmt demo`: the venv is not activated."""
    other = tmp_path / "other" / "bin" / "dsmt"
    other.parent.mkdir(parents=True)
    other.write_text("")
    monkeypatch.chdir(tmp_path / "repo")
    on_path = str(other) if elsewhere else None
    assert dsmt_command(on_path=on_path, executable=".venv/bin/python", argv0=".venv/bin/dsmt") == str(venv / "dsmt")
    assert dsmt_command(on_path=on_path, executable=str(venv / "python"), argv0="-c") == str(venv / "dsmt")


def test_the_summary_hint_names_that_command(tmp_path):
    files = DemoFiles(workdir=tmp_path / "dsmt demo")
    files.add(files.spec, "the job spec")
    command = "/home/me/repo/.venv/bin/dsmt"
    summary = files.summary(passed=True, seconds=1.0, samples=(["the catw1w2"], ["the cat drinks milk."]),
                            spec={"training": {"train_steps": 4}}, losses=(5.0, 0.1), dsmt=command)
    hint = summary.splitlines()[-1]
    assert hint.startswith(f"next: cd '{files.workdir}'; {command} check demo-job.yaml; {command} train ")
    assert f"; {command} plan llama3-8b" in hint and not re.search(r"(^|[;:] )dsmt ", hint)


def test_the_pipeline_picture_states_plan_txts_bubble(tmp_path):
    """The demo's layout (pp=2, 2 micro-batches per step): plan.txt's bubble (p-1)/(v*m) is 50%; the drawn
    timeline is idle 1/3 of its span (the same idle time over busy + idle), which the title labels apart."""
    from toolkit.models.shapes import BUILTIN_SHAPES
    from toolkit.plan.charts import pipeline_chart
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
    from toolkit.plan.report import explain
    from toolkit.plan.search import evaluate, plan

    shape, training = BUILTIN_SHAPES["llama3-8b"], TrainingShape(seq_length=4096, global_batch_size=8)
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu=get_gpu("h100-80gb"))
    layout = PlanLayout(tp=1, pp=2, dp=2, zero_stage=1, micro_batch_size=2)
    result = plan(shape=shape, training=training, cluster=cluster)
    plan_txt = explain(shape=shape, layout=layout, training=training, cluster=cluster, result=result)
    candidate = evaluate(shape=shape, layout=layout, training=training, cluster=cluster)
    pipeline_chart(result=result, candidate=candidate, out_dir=tmp_path)
    # matplotlib's SVG keeps each text as a comment beside its glyphs
    texts = re.findall(r"<!-- (.*?) -->", (tmp_path / "pipeline.svg").read_text(), flags=re.S)
    title = next(text for text in texts if "bubble" in text)
    planner = re.findall(r"bubble \(p-1\)/\(v\*m\) = ([\d.]+%)", plan_txt)
    assert planner == ["50.0%"]
    assert re.findall(r"bubble[^;]*?([\d.]+%)", title) == planner  # the only "bubble" figure, and plan.txt's
    assert "drawn: stages idle 33.3% of the timeline" in title


def test_the_demo_plan_names_its_gpu_cluster_and_shows_the_tiny_models_figures():
    """The demo's model and layout planned on 4 x H100: a 0.1 ms step and 74 k parameters per GPU, which fixed
    units printed as "0.000 s" and "0.00 B"; the preamble says it is not the CPU run and why the planner ranks the
    demo's pp=2 below pure data parallelism; the last line names the terms that make the difference."""
    from toolkit.demo.plan import PLAN_GPU, console_lines, plan_text
    from toolkit.models.shapes import BUILTIN_SHAPES
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
    from toolkit.plan.search import plan

    shape, training = BUILTIN_SHAPES["tiny-llama"], TrainingShape(seq_length=64, global_batch_size=8)
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu=get_gpu(PLAN_GPU))
    layout = PlanLayout(tp=1, pp=2, dp=2, zero_stage=1, micro_batch_size=2)
    result = plan(shape=shape, training=training, cluster=cluster)
    text = plan_text(shape=shape, layout=layout, training=training, cluster=cluster, result=result)
    assert "on 1 node x 4 h100-80gb, not the CPU run" in text and "the planner chooses tp=1 pp=1 dp=4" in text
    assert not re.search(r"\b0\.0+ (B|s|PFLOP)\b|likely 0\.00-0\.00", text), text  # every figure shows its value
    assert re.search(r"\[[\d.]+ k params/GPU", text) and re.search(r"step time [\d.]+ µs = ", text)
    rank = re.search(r"rank (\d+) of (\d+) fitting layouts", text)
    assert rank and int(rank[1]) > 1
    why = re.search(r"why: the terms that differ most, this layout minus the choice: (.*)", text)[1]
    assert "bubble +" in why and "pp p2p +" in why  # what a second pipeline stage costs a model this small
    first, ranked, because = console_lines(text)  # the console: which cluster, then the rank and why
    assert "not the CPU run" in first and ranked.startswith(f"  {rank[0]};") and because.endswith(why)
