"""Search rules, memory-model properties, and the `dsmt plan` command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.cli import main
from toolkit.errors import DsmtError
from toolkit.plan.hardware import GPU_PRESETS, get_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import estimate_memory
from toolkit.plan.search import SIMPLICITY_ORDER, evaluate, layout_violations, plan, rank_candidates, simplicity_key
from toolkit.models.shapes import BUILTIN_SHAPES

LLAMA70 = BUILTIN_SHAPES["llama3-70b"]
H100x64 = Cluster(nodes=8, gpus_per_node=8, gpu=get_gpu("h100-80gb"))
TRAIN = TrainingShape(seq_length=4096, global_batch_size=1024)
BASE = ["plan", "llama3-70b", "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--seq-len", "4096",
        "--global-batch", "1024"]


@pytest.fixture(scope="module")
def llama_plan():
    return plan(shape=LLAMA70, training=TRAIN, cluster=H100x64)


def test_plan_ranks_fitting_valid_layouts(llama_plan):
    assert llama_plan.fitting, "a 70B model must fit on 64 H100s"
    # the planner's order: ties with the fastest (within time_uncertainty) simplest first, then the rest by time
    fastest = llama_plan.fastest.time.step_time_s
    assert fastest == min(c.time.step_time_s for c in llama_plan.fitting)
    limit = fastest * (1 + llama_plan.assumptions.time_uncertainty)
    ties = [c for c in llama_plan.fitting if c.time.step_time_s <= limit]
    assert llama_plan.fitting[:len(ties)] == ties and len(ties) >= 1
    keys = [simplicity_key(layout=c.layout, cluster=H100x64) for c in ties]
    assert keys == sorted(keys)
    rest = [c.time.step_time_s for c in llama_plan.fitting[len(ties):]]
    assert rest == sorted(rest) and all(r > limit for r in rest)
    for c in llama_plan.fitting + llama_plan.rejected:
        assert layout_violations(shape=LLAMA70, layout=c.layout, training=TRAIN, cluster=H100x64) == []
        assert not (c.layout.pp > 1 and c.layout.zero_stage >= 2)
    assert all(c.memory.total_bytes <= c.memory.capacity_bytes for c in llama_plan.fitting)
    assert all(c.memory.total_bytes > c.memory.capacity_bytes for c in llama_plan.rejected)
    # the rejected ones shown would be faster than the fastest that fits
    assert all(c.time.step_time_s < fastest for c in llama_plan.rejected)
    # 70B in bf16 with Adam needs > 1 TB of model states: no tp=1, pp=1 layout without ZeRO-3 fits
    assert not any(c.layout.tp == c.layout.pp == 1 and c.layout.zero_stage < 3 for c in llama_plan.fitting)


def test_violations_name_values_and_fixes():
    bad = PlanLayout(tp=3, pp=3, dp=7, zero_stage=2, micro_batch_size=5)
    problems = " | ".join(layout_violations(shape=LLAMA70, layout=bad, training=TRAIN, cluster=H100x64))
    assert "world_size=64 (nodes × gpus_per_node) is not divisible by tp×cp×pp=3×1×3=9" in problems
    assert "tp=3 does not divide num_attention_heads=64; fix: valid tp: 1, 2, 4, 8" in problems
    assert "num_layers=80 is not divisible by pp×vpp=3×1=3" in problems
    assert "zero_stage=2 with pp=3 is unsupported" in problems


def test_unknown_gpu_lists_presets():
    with pytest.raises(DsmtError, match="valid presets: a100-40gb, a100-80gb, h100-80gb, h200-141gb"):
        get_gpu("v100")
    assert GPU_PRESETS["h100-80gb"].peak_bf16_tflops == 989.0 and GPU_PRESETS["a100-80gb"].nvlink_gbps == 300.0


def test_all_stages_worst_is_first_or_last():
    for layout in [PlanLayout(tp=8, pp=4, dp=2), PlanLayout(tp=4, pp=8, dp=2, vpp=2), PlanLayout(tp=2, pp=16, dp=2)]:
        full = estimate_memory(shape=LLAMA70, layout=layout, training=TRAIN, gpu=H100x64.gpu, all_stages=True)
        quick = estimate_memory(shape=LLAMA70, layout=layout, training=TRAIN, gpu=H100x64.gpu)
        assert len(full.stages) == layout.pp and full.total_bytes == quick.total_bytes


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4, 8]), mbs=st.sampled_from([1, 2, 4]),
       zero=st.sampled_from([0, 1, 2, 3]))
def test_memory_orderings(tp, pp, mbs, zero):
    """More recompute never stores more; a higher ZeRO stage never holds more model state (ZeRO-3 against ZeRO-2
    only from dp >= 3: measured, ZeRO-3 holds 22/dp bytes per parameter and ZeRO-2 2 + 16/dp); more dp with ZeRO
    never holds more."""
    def mem(**kw):
        layout = PlanLayout(**{**dict(tp=tp, pp=pp, dp=64 // (tp * pp), zero_stage=zero, micro_batch_size=mbs), **kw})
        return estimate_memory(shape=LLAMA70, layout=layout, training=TRAIN, gpu=H100x64.gpu,
                               assumptions=dataclasses.replace(plan_assumptions(), attention="local"))
    acts = [mem(recompute=r).activations for r in ("none", "selective", "full")]
    assert acts[0] >= acts[1] >= acts[2] > 0
    stages = (0, 1, 2, 3) if 64 // (tp * pp) >= 3 else (0, 1, 2)
    states = [sum(list(mem(zero_stage=z).by_category().values())[:3]) for z in stages]
    assert states == sorted(states, reverse=True)
    if zero >= 1 and tp * pp <= 32:
        wide = PlanLayout(tp=tp, pp=pp, dp=128 // (tp * pp), zero_stage=zero, micro_batch_size=mbs)
        wide_mem = estimate_memory(shape=LLAMA70, layout=wide, training=TrainingShape(4096, 2048), gpu=H100x64.gpu)
        assert wide_mem.optimizer < mem().optimizer


def plan_assumptions():
    from toolkit.plan.assumptions import Assumptions

    return Assumptions()


def test_cli_table_and_rejections(capsys, llama_plan):
    assert main(BASE + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{llama_plan.evaluated} layouts evaluated, {len(llama_plan.fitting)} fit" in out
    assert "best rejected" in out and "MFU" in out and out.count("\n  1 ") + out.count("\n  3 ") == 2


def test_cli_json(capsys):
    assert main(BASE + ["--json", "--top", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    first = data["layouts"][0]
    for key in ("tp", "pp", "vpp", "dp", "zero_stage", "micro_batch_size", "recompute", "memory_gb", "step_time_s"):
        assert key in first
    assert first["tp"] * first["cp"] * first["pp"] * first["dp"] == 64 and first["memory_gb"] <= 85.6
    choice = data["choice"]
    assert set(choice) == {"preferred_for_simplicity", "time_uncertainty", "fastest", "note"}
    fastest_s = min(x["step_time_s"] for x in data["layouts"])
    assert first["step_time_s"] <= fastest_s * (1 + choice["time_uncertainty"]) + 1e-3
    parts = first["step_breakdown_s"]
    assert sum(parts.values()) == pytest.approx(first["step_time_s"], abs=1e-3)  # the parts add up to the step


def test_cli_emit_spec_exact_keys(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    assert main(BASE + ["--emit-spec", str(path)]) == 0
    spec = yaml.safe_load(path.read_text())
    assert spec["model"] == {"builtin": "llama3-70b"}
    assert spec["cluster"] == {"nodes": 8, "gpus_per_node": 8, "gpu": "h100-80gb", "hosts": "slurm"}
    assert set(spec["parallel"]) == {"tp", "pp", "vpp", "cp", "sequence_parallel", "zero_stage", "offload_optimizer"}
    assert set(spec["training"]) == {"global_batch_size", "micro_batch_size", "seq_length", "precision", "recompute", "attention"}
    assert list(spec) == ["model", "cluster", "parallel", "training", "data"] and spec["training"]["precision"] == "bf16"
    assert spec["data"] == {"synthetic": True} and spec["parallel"]["sequence_parallel"] == (spec["parallel"]["tp"] > 1)
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]  # no temp file left behind


def test_cli_explain(capsys):
    assert main(BASE + ["--explain", "tp=8 pp=4 zero=1 mbs=1"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "stage 0:" in out and "step time" in out and "rank" in out
    assert main(BASE + ["--explain", "tp=1 pp=1 zero=1 mbs=1"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(BASE + ["--explain", "tp=3 pp=4 zero=2"]) == 0
    out = capsys.readouterr().out
    assert "INVALID" in out and "valid tp: 1, 2, 4, 8" in out and "zero_stage=2 with pp=4 is unsupported" in out


def test_cli_gpt2_config_json_and_custom_gpu(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}))
    args = ["plan", str(config), "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "1024", "--global-batch", "8"]
    assert main(args + ["--gpu", "custom", "--gpu-mem-gb", "24", "--peak-tflops", "165", "--nvlink-gbps", "32",
                        "--ib-gbps", "12", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpu_memory_gb"] == 24.0 and data["layouts"]
    assert main(args + ["--gpu", "custom", "--gpu-mem-gb", "24"]) == 2
    assert "missing: --peak-tflops" in capsys.readouterr().err
    assert main(args + ["--gpu", "v100"]) == 2


def test_cli_no_fit_exit_code(capsys):
    args = ["plan", "gpt-1t", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100-40gb", "--seq-len", "2048",
            "--global-batch", "64"]
    assert main(args) == 1
    assert "closest to fitting" in capsys.readouterr().out


def test_efficiency_override_scales_compute(capsys):
    explain = ["--explain", "tp=8 pp=2 zero=1 mbs=1"]
    assert main(BASE + explain) == 0
    default_compute_s = float(capsys.readouterr().out.split("= compute ")[1].split()[0])
    assert main(BASE + ["--efficiency", "0.26"] + explain) == 0  # half H100's fitted 0.52
    halved_compute_s = float(capsys.readouterr().out.split("= compute ")[1].split()[0])
    assert halved_compute_s == pytest.approx(2 * default_compute_s, rel=1e-3)


def test_estimate_memory_standalone_errors_and_require_fit():
    from toolkit.plan.memory import require_fit

    with pytest.raises(DsmtError, match=r"pp\(3\) \* vpp\(1\) does not divide num_layers=80; valid pp \* vpp: 1, 2"):
        estimate_memory(shape=LLAMA70, layout=PlanLayout(tp=8, pp=3, dp=1), training=TRAIN, gpu=H100x64.gpu)
    too_big = estimate_memory(shape=LLAMA70, layout=PlanLayout(tp=1, pp=1, dp=64), training=TRAIN, gpu=H100x64.gpu)
    with pytest.raises(DsmtError, match="needs .* GB per GPU on pipeline stage 0 .* but the GPU has 85.5 GB"):
        require_fit(too_big)
    require_fit(estimate_memory(shape=LLAMA70, layout=PlanLayout(tp=8, pp=4, dp=2), training=TRAIN, gpu=H100x64.gpu))


def test_charts_written(tmp_path, llama_plan):
    from toolkit.plan.charts import draw_charts

    paths = draw_charts(result=llama_plan, candidate=llama_plan.best, out_dir=tmp_path)
    assert sorted(p.name for p in paths) == ["memory.png", "memory.svg", "pipeline.png", "pipeline.svg"]
    assert all(p.stat().st_size > 5000 for p in paths)
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"<svg" in paths[1].read_bytes()[:500]


def _tied_candidates(**times):
    """Real candidates of BASE's cluster with their predicted step times replaced (label -> seconds)."""
    layouts = {"pp1": PlanLayout(tp=8, pp=1, dp=8, sp=True, zero_stage=1),
               "pp2": PlanLayout(tp=8, pp=2, dp=4, sp=True, zero_stage=1),
               "pp2vpp2": PlanLayout(tp=8, pp=2, vpp=2, dp=4, sp=True, zero_stage=1)}
    out = []
    for name, seconds in times.items():
        c = evaluate(shape=LLAMA70, layout=layouts[name], training=TRAIN, cluster=H100x64)
        out.append(dataclasses.replace(c, time=dataclasses.replace(c.time, step_time_s=seconds)))
    return out


def test_simplicity_preference_within_uncertainty_only():
    """pp=1 predicted 4% slower than pp=2: a tie at 6% uncertainty (the simpler wins), not at 3% or 0."""
    cands = _tied_candidates(pp2vpp2=1.00, pp2=1.02, pp1=1.04)
    first = lambda u: rank_candidates(fitting=cands, cluster=H100x64, uncertainty=u)[0].layout
    assert first(0.06).pp == 1
    assert (first(0.03).pp, first(0.03).vpp) == (2, 1)  # fewer virtual stages among the two within 3%
    assert (first(0.0).pp, first(0.0).vpp) == (2, 2)    # no uncertainty: the fastest
    assert SIMPLICITY_ORDER[:3] == ("TP group inside one node", "fewer pipeline stages",
                                    "fewer virtual pipeline stages")


def test_plan_text_and_explain_name_a_simplicity_choice(capsys):
    """With a wide uncertainty the choice differs from the fastest prediction: the table and --explain of either
    name both layouts and the margin."""
    wide = ["--time-uncertainty", "0.25"]
    assert main(BASE + wide + ["--json"]) == 0
    choice = json.loads(capsys.readouterr().out)["choice"]
    assert choice["preferred_for_simplicity"] and choice["fastest"] in choice["note"]
    assert main(BASE + wide) == 0
    out = capsys.readouterr().out
    assert "is preferred for simplicity (" in out and choice["fastest"] in out and "% faster, within" in out
    fastest = choice["fastest"].replace(" sp", "")
    assert main(BASE + wide + ["--explain", fastest]) == 0
    out = capsys.readouterr().out
    assert "the choice is predicted" in out and "is preferred for simplicity" in out and choice["fastest"] in out
    assert main(BASE + ["--time-uncertainty", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["choice"]["preferred_for_simplicity"] is False


def test_time_overrides_are_checked(capsys):
    assert main(BASE + ["--cp-overlap", "1.5"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(BASE + ["--time-uncertainty", "-0.1"]) == 2
    assert main(BASE + ["--dp-overlap", "0", "--top", "1"]) == 0
