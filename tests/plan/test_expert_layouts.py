"""The planner's top choice against the layouts experts published (toolkit/plan/published.py).

Compared: (tp, pp) of the planner's first choice for the run's model, GPUs, global batch and sequence length,
with its default assumptions. The set is every published run whose layout megatron-core can express (equal stage
split) and whose memory premise the planner shares (optimizer state sharded over data parallelism); the printed
table also lists the rest (Megatron-LM 2021 replicated the optimizer; Llama 3 and BLOOM-style uneven splits).
"""

from __future__ import annotations

import pytest

from toolkit.plan.published import RUNS, expert_runs, expressible, model_shape, planner_choice

# Issue item 7 asks for 8 in 10. Reached today: see test_agreement_target; the floor below guards what is reached.
TARGET_AGREEMENT = 0.8
FLOOR_AGREEMENT = 0.5


@pytest.fixture(scope="module")
def table():
    rows = []
    for run in RUNS:
        best = planner_choice(run) if expressible(run) else None
        got = (best.layout.tp, best.layout.pp) if best else None
        rows.append((run, best, got == (run.tp, run.pp)))
    print(f"\n{'model / cluster':36s} {'published':>10s}  {'planner':54s} agree  in set")
    for run, best, agree in rows:
        ours = best.layout.label() if best else ("not expressible" if not expressible(run) else "nothing fits")
        print(f"{run.label:36s} tp{run.tp:<2} pp{run.pp:<3}  {ours:54s} {'yes' if agree else 'NO ':5s}  "
              f"{'yes' if run in expert_runs() else 'no'}")
    return rows


def _agreement(rows) -> float:
    scored = [agree for run, _, agree in rows if run in expert_runs()]
    return sum(scored) / len(scored)


def test_expert_set_is_broad():
    runs = expert_runs()
    sizes = [model_shape(r.model).num_params() for r in runs]
    assert len(runs) >= 12
    assert len({r.source for r in runs}) >= 3 and {r.gpu for r in runs} >= {"a100-80gb", "h100-80gb"}
    assert min(sizes) < 10e9 and max(sizes) > 150e9
    assert {r.tp for r in runs} >= {1, 2, 4, 8} and max(r.pp for r in runs) >= 8 and any(r.cp > 1 for r in runs)


def test_agreement_floor(table):
    share = _agreement(table)
    print(f"agreement {share:.0%} on {len(expert_runs())} published layouts")
    assert share >= FLOOR_AGREEMENT


@pytest.mark.xfail(strict=True, reason="issue item 7's 8-in-10 target is not reached (report: framework and memory "
                                       "differences); strict, so reaching it fails here and the floor is raised")
def test_agreement_target(table):
    assert _agreement(table) >= TARGET_AGREEMENT


def test_choices_use_tp_inside_a_node(table):
    for run, best, _ in table:
        if best is not None:
            assert best.layout.tp <= 8, run.label
