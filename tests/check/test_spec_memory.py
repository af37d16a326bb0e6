"""`check_memory_fit`: the planner's estimate, reported as info when the spec fits and as an error when not."""

import dataclasses

from spec_helpers import tiny_spec
from toolkit.plan.assumptions import Assumptions
from toolkit.cli import main
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import PlanLayout, TrainingShape
from toolkit.plan.memory import estimate_memory
from toolkit.models.shapes import BUILTIN_SHAPES
from toolkit.check.checks import check_file


def _gpu_spec(**sections) -> dict:
    """Llama-3-8B on one node of 8 H100s: tp 2, dp 4, ZeRO-1, selective recompute (fits)."""
    raw = {"model": {"builtin": "llama3-8b"}, "cluster": {"gpu": "h100-80gb"},
           "parallel": {"tp": 2, "sequence_parallel": True, "zero_stage": 1},
           "training": {"global_batch_size": 64, "micro_batch_size": 2, "seq_length": 4096, "recompute": "selective"},
           "data": {"synthetic": True}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def _memory_problems(report):
    return [p for p in report.problems if p.rule == "memory_fit"]


def test_fitting_spec_reports_the_planners_number(write_spec):
    _, report = check_file(write_spec(_gpu_spec()))
    expected = estimate_memory(
        shape=BUILTIN_SHAPES["llama3-8b"],
        layout=PlanLayout(tp=2, pp=1, dp=4, zero_stage=1, micro_batch_size=2, recompute="selective",
                      sp=True),
        training=TrainingShape(seq_length=4096, global_batch_size=64), gpu=get_gpu("h100-80gb"))
    assert expected.fits
    [problem] = _memory_problems(report)
    assert report.ok, report.to_text()
    assert problem.severity == "info"
    assert f"predicted {expected.total_bytes / 1e9:.1f} GB per GPU of {expected.capacity_bytes / 1e9:.1f} GB" \
        in problem.message


def test_spec_that_cannot_fit_is_an_error_with_the_breakdown_and_fixes(write_spec, tmp_path, capsys):
    raw = _gpu_spec(model={"builtin": "llama3-70b"}, cluster={"gpu": "a100-40gb"},
                    parallel={"tp": 1, "sequence_parallel": False, "zero_stage": 0},
                    training={"micro_batch_size": 1, "recompute": "none"})
    path = write_spec(raw)
    _, report = check_file(path)
    [problem] = _memory_problems(report)
    assert problem.severity == "error" and not report.ok
    for part in ("per GPU on pipeline stage 0", "parameters", "optimizer", "activations", "a100-40gb",
                 "tp=1 pp=1 dp=8 zero=0"):
        assert part in problem.message
    for fix in ("parallel.zero_stage=3", "training.recompute=full", "dsmt plan llama3-70b"):
        assert fix in problem.fix
    assert main(["check", path]) == 2
    assert main(["generate", path, "--out", str(tmp_path / "run")]) == 2  # generate runs the same checks
    assert "[memory_fit]" in capsys.readouterr().err and not (tmp_path / "run").exists()


def _reported_gb(report) -> float:
    return float(_memory_problems(report)[0].message.split("predicted ")[1].split(" GB")[0])


def _planner_gb(assumptions) -> float:
    layout = PlanLayout(tp=2, pp=1, dp=4, zero_stage=1, micro_batch_size=2, recompute="selective", sp=True)
    memory = estimate_memory(shape=BUILTIN_SHAPES["llama3-8b"], layout=layout, assumptions=assumptions,
                             training=TrainingShape(seq_length=4096, global_batch_size=64), gpu=get_gpu("h100-80gb"))
    return round(memory.total_bytes / 1e9, 1)


def test_check_passes_the_precision_to_the_memory_model(write_spec):
    """fp32: 4-byte weights, gradients and activations, and DeepSpeed's fp32 buffers (toolkit/plan/model_states.py)."""
    bf16 = _reported_gb(check_file(write_spec(_gpu_spec(), name="bf16.yaml"))[1])
    fp32 = _reported_gb(check_file(write_spec(_gpu_spec(training={"precision": "fp32"}), name="fp32.yaml"))[1])
    assert fp32 > bf16
    assert bf16 == _planner_gb(Assumptions.for_precision("bf16"))
    assert fp32 == _planner_gb(Assumptions.for_precision("fp32"))


def test_check_passes_the_attention_kind(write_spec):
    """training.attention: local stores the s x s scores (auto is fused on a GPU)."""
    fused = _reported_gb(check_file(write_spec(_gpu_spec(), name="auto.yaml"))[1])
    local = _reported_gb(check_file(write_spec(_gpu_spec(training={"attention": "local", "recompute": "none"}),
                                               name="local.yaml"))[1])
    assert fused == _planner_gb(Assumptions(attention="fused"))
    assert local > fused


def test_zero3_build_peak_counts_in_the_fit():
    """ZeRO-3 builds partitioned (zero.Init) and loads one parameter at a time: the build holds this rank's
    partition and the largest tensor (the embedding); `fits` takes the larger of build and training."""
    shape, training = BUILTIN_SHAPES["llama3-8b"], TrainingShape(seq_length=4096, global_batch_size=64)
    layout = PlanLayout(tp=1, pp=1, dp=8, zero_stage=3, micro_batch_size=1, recompute="full")
    memory = estimate_memory(shape=shape, layout=layout, training=training, gpu=get_gpu("h100-80gb"))
    params = memory.params_per_gpu
    embedding = 128256 * 4096  # 128256 is already a multiple of 128
    assert memory.build_peak_bytes == 2 * (-(-params // 8) + embedding) + int(2.5e9)
    assert memory.peak_bytes == max(memory.total_bytes, memory.build_peak_bytes)
    small = dataclasses.replace(memory, capacity_bytes=(memory.total_bytes + memory.build_peak_bytes) // 2)
    assert small.fits == (max(memory.build_peak_bytes, memory.total_bytes) <= small.capacity_bytes)


def test_cpu_runs_are_not_modelled(write_spec):
    _, report = check_file(write_spec(tiny_spec()))
    assert [p.message for p in _memory_problems(report)] == ["memory fit: not modelled for CPU runs"]


def test_invalid_layout_is_left_to_the_divisibility_checks(write_spec):
    _, report = check_file(write_spec(_gpu_spec(parallel={"pp": 3})))
    assert "world_size" in report.rules("error") and "memory_fit" not in report.rules("error")


def test_planner_inputs_carry_the_specs_communication_settings():
    """The time model's DP traffic reads the spec's bucket sizes and communication_data_type (zero_traffic.py)."""
    from toolkit.check.checks import planner_inputs
    from toolkit.spec.schema import JobSpec

    raw = _gpu_spec(communication={"communication_data_type": "bf16", "reduce_bucket_elements": 1000})
    _, _, _, assumptions = planner_inputs(JobSpec.model_validate(raw))
    assert (assumptions.dp_grad_comm_bytes, assumptions.reduce_bucket_elements) == (2, 1000)
    _, _, _, default = planner_inputs(JobSpec.model_validate(_gpu_spec()))
    assert default.dp_grad_comm_bytes == 4
