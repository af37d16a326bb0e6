"""The planner's first choice against the layouts experts published (toolkit/plan/published.py), each asked the
question the run answered: its model, GPUs, global batch and sequence length under its premise (the sharding it
ran, e.g. a replicated optimizer = ZeRO-0, and its recompute choice; published.premise) and its own setup
(attention kernel, dropout: published.run_assumptions).

The expected (tp, pp) are the sources' own. A choice agrees when it is the authors' TP x PP, or when the authors'
TP x PP (its best micro-batch and interleaving) is predicted within the stated uncertainty of the choice (the band
`dsmt plan` prints, calibration.py): the model cannot tell them apart. Runs whose layout megatron-core cannot
express (uneven stages: Llama 3 405B, BLOOM) or whose sharding the source does not state (MT-NLG), and the
ZeRO-3 / FSDP runs (no TP or PP to choose), are printed but not scored. The runs the planner still misses are
named below with the reason; the test fails if another one misses, or if a named one stops missing.
"""

from __future__ import annotations

import math

import pytest

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.calibration import band, run_kind
from toolkit.plan.published import RUNS, expert_runs, expressible, planner_plan

KNOWN_MISSES = {
    "gpt-18.4b on 256 a100-80gb": "the model prices TP 8's per-layer all-reduces and its norms replicated without "
                                  "sequence parallelism above what was measured (it under-predicts this tp8 pp1 "
                                  "run by 8 %), so tp4 pp2 looks 11.6 % faster",
    "gpt-39.1b on 512 a100-80gb": "the same bias: the authors' tp8 pp2 is predicted 6.7 % slower than tp4 pp4, just "
                                  "outside the ±5.6 % band",
    "llama3-8b on 8 h100-80gb": "NeMo ran fp8 with cp 2 at seq 8192; the model times bf16 only, and prices the "
                                "context-parallel ring above tp 2",
}


def _band(run) -> float:
    """The stated uncertainty of the run's kind of layout, as a ratio of step times (exp of the RMS log error)."""
    return math.exp(band(kind=run_kind(run), assumptions=Assumptions()).relative) - 1


def _authors(plan, run):
    """The fastest fitting candidate with the authors' tp and pp, or None."""
    return next((c for c in sorted(plan.fitting, key=lambda c: c.time.step_time_s)
                 if (c.layout.tp, c.layout.pp) == (run.tp, run.pp)), None)


@pytest.fixture(scope="module")
def table():
    rows = []
    for run in RUNS:
        if run not in expert_runs():
            rows.append((run, None, None, None))
            continue
        plan = planner_plan(run)
        best, theirs = plan.best, _authors(plan, run)
        margin = theirs.time.step_time_s / best.time.step_time_s - 1 if best and theirs else None
        rows.append((run, plan, best, margin))
    print(f"\n{'model / cluster':34s} {'premise':18s} {'published':>10s}  {'planner':50s} theirs")
    for run, plan, best, margin in rows:
        ours = best.layout.label() if best else ("nothing fits" if plan else "not expressible" if not expressible(run)
                                                 else "-")
        theirs = "-" if margin is None else ("same" if (best.layout.tp, best.layout.pp) == (run.tp, run.pp)
                                             else f"{margin:+.1%}")
        premise = f"zero {run.layout().zero_stage}, {run.recompute or 'any'}"
        print(f"{run.label:34s} {premise:18s} tp{run.tp:<2} pp{run.pp:<3}  {ours:50s} {theirs}"
              f"{'' if run in expert_runs() else '  (not scored)'}")
    return rows


def test_expert_set_is_broad():
    runs = expert_runs()
    assert len(runs) >= 12
    assert len({r.source for r in runs}) >= 3 and {r.gpu for r in runs} >= {"a100-80gb", "h100-80gb"}
    assert {r.tp for r in runs} >= {1, 2, 4, 8} and max(r.pp for r in runs) >= 8 and any(r.cp > 1 for r in runs)
    assert {r.zero_stage for r in runs} >= {0, 1}


def test_first_choice_is_the_authors_layout_or_within_the_uncertainty(table):
    exact = within = 0
    misses = []
    for run, plan, best, margin in table:
        if run not in expert_runs():
            continue
        assert best is not None, f"{run.label}: nothing fits under its premise"
        if (best.layout.tp, best.layout.pp) == (run.tp, run.pp):
            exact += 1
        elif margin is not None and margin <= _band(run):
            within += 1
        else:
            misses.append(f"{run.label}: chose {best.layout.label()}, the authors' tp{run.tp} pp{run.pp} "
                          + ("does not fit" if margin is None else f"predicted {margin:.1%} slower"))
    scored = len(expert_runs())
    print(f"authors' TP x PP first: {exact} of {scored}; within the uncertainty: {within}; missed: {len(misses)}")
    missed = {m.split(":")[0] for m in misses}
    assert missed == set(KNOWN_MISSES), "\n".join(misses) + f"\nnamed: {sorted(KNOWN_MISSES)}"


def test_choices_never_put_a_tp_group_across_nodes(table):
    for run, plan, best, _ in table:
        if best is not None:
            assert best.layout.tp <= run.gpus_per_node, run.label
