"""`dsmt plan --zero-stages --max-tp --max-pp --recompute --allow-offload / --no-offload`: the search proposes only
what the user allows, says so in its header and JSON, and refuses limits that cannot be met by name."""

from __future__ import annotations

import json

import pytest

from toolkit.cli import main
from toolkit.errors import DsmtError
from toolkit.plan.search import SearchLimits

ARGS = ["plan", "gpt-18.4b", "--nodes", "32", "--gpu", "a100-80gb", "--seq-len", "2048", "--global-batch", "1024",
        "--json", "--top", "50"]


def _layouts(capsys, *extra) -> dict:
    assert main(ARGS + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_limits_restrict_every_proposed_layout(capsys):
    found = _layouts(capsys, "--zero-stages", "0", "--max-tp", "4", "--max-pp", "2", "--recompute", "full")
    assert found["search_limits"] == "zero stages 0; tp <= 4; pp <= 2; recompute full"
    layouts = found["layouts"]
    assert layouts and all(x["zero_stage"] == 0 and x["tp"] <= 4 and x["pp"] <= 2 and x["recompute"] == "full"
                           for x in layouts)
    assert not any(x["offload_optimizer"] for x in layouts)
    free = _layouts(capsys)
    assert free["search_limits"] is None and {x["zero_stage"] for x in free["layouts"]} <= {1, 2, 3}


def test_offload_only_when_allowed(capsys):
    offloaded = _layouts(capsys, "--allow-offload", "--zero-stages", "1", "--top", "400")
    assert any(x["offload_optimizer"] for x in offloaded["layouts"])
    never = _layouts(capsys, "--no-offload", "--zero-stages", "1", "--top", "400")
    assert not any(x["offload_optimizer"] for x in never["layouts"])
    with pytest.raises(SystemExit) as refused:   # argparse: the two flags exclude each other
        main(ARGS + ["--allow-offload", "--no-offload"])
    assert refused.value.code == 2


@pytest.mark.parametrize("flags, message", [
    (["--zero-stages", "4"], "zero stages [4] must be a non-empty subset of 0, 1, 2, 3"),
    (["--zero-stages", "one"], "--zero-stages='one' must list stages as integers"),
    (["--recompute", "some"], "recompute ['some'] must be a non-empty subset of none, selective, full"),
    (["--max-tp", "0"], "--max-tp 0 must be at least 1"),
    (["--max-mbs", "0"], "--max-mbs 0 must be at least 1"),
])
def test_bad_limits_are_named(capsys, flags, message):
    assert main(ARGS + flags) == 2
    assert message in capsys.readouterr().err


def test_replicated_optimizer_spec_passes_check(tmp_path, capsys):
    """--zero-stages 0 emits a spec dsmt check accepts: bf16 without ZeRO accumulates in bf16."""
    from toolkit.check.checks import check_file

    spec = tmp_path / "z.yaml"
    assert main(["plan", "llama3-8b", "--nodes", "1", "--seq-len", "4096", "--global-batch", "64",
                 "--zero-stages", "0", "--emit-spec", str(spec)]) == 0
    _, report = check_file(spec)
    assert report.ok, report.to_text()
    assert "grad_accum_dtype: bf16" in spec.read_text()


def test_calibration_refuses_a_question(capsys):
    assert main(["plan", "--calibration", "llama3-8b", "--nodes", "2"]) == 2
    assert "it takes no question (MODEL, --nodes)" in capsys.readouterr().err


def test_limits_no_layout_meets_names_them():
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Cluster, TrainingShape
    from toolkit.plan.published import model_shape
    from toolkit.plan.search import plan

    cluster = Cluster(nodes=1, gpus_per_node=8, gpu=get_gpu("a100-80gb"))
    # 8 GPUs at tp 1, pp 1 are 8 replicas, which a global batch of 4 cannot feed
    with pytest.raises(DsmtError, match=r"searched only: tp <= 1; pp <= 1; relax those limits"):
        plan(shape=model_shape("gpt-18.4b"), training=TrainingShape(2048, 4), cluster=cluster,
             limits=SearchLimits(max_tp=1, max_pp=1))
