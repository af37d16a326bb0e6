"""DPO in the planner (toolkit/plan/dpo.py): the frozen reference's weights, the pairs' rows, the reference forward's
time, and what `dsmt plan` says about them. `pytest -s` prints Llama-3-70B's figures at a 4 x 8 H100 layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from toolkit.cli import main
from toolkit.models.shapes import BUILTIN_SHAPES
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.dpo import DpoShape, dpo_shape_of, reference_forward_bytes
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layers import stage_params_per_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.lora import LoraShape
from toolkit.plan.memory import estimate_memory, stage_memory
from toolkit.plan.report import explain, format_table, plan_dict
from toolkit.plan.search import plan
from toolkit.plan.timing import estimate_step_time

TINY = BUILTIN_SHAPES["tiny-llama"]  # hidden 64, 4 layers, 8 heads / 2 KV heads (head dim 8), ffn 96, vocab 250
BF16, FP32 = Assumptions.for_precision("bf16"), Assumptions.for_precision("fp32")
H100 = get_gpu("h100-80gb")
BASE, PRECOMPUTED = DpoShape(reference="base"), DpoShape(reference="precomputed")
CONFIG = Path(__file__).parents[2] / "configs" / "templates" / "dpo-llama3-8b-tp2-lora.yaml"


def _training(dpo=None, lora=None, *, seq=64, batch=64) -> TrainingShape:
    return TrainingShape(seq_length=seq, global_batch_size=batch, lora=lora, dpo=dpo)


# tiny-llama at tp 2, by hand: a layer holds linear_qkv (8 + 2·2)·8·64 / 2 = 3072, linear_proj 64·64 / 2 = 2048,
# linear_fc1 2·96·64 / 2 = 6144, linear_fc2 64·96 / 2 = 3072 and two norms of 64: 14,464. pp 2 puts 2 layers on each
# stage; the vocabulary 250 pads to 256, 128 rows per rank: the embedding (stage 0) and the output layer (stage 1)
# 128·64 = 8192 each, and the final norm 64 on stage 1.
TINY_TP2_PP2_STAGE_PARAMS = (2 * 14_464 + 8192, 2 * 14_464 + 64 + 8192)


@pytest.mark.parametrize("zero_stage", [0, 1])
@pytest.mark.parametrize("assumptions, width", [(BF16, 2), (FP32, 4)])
def test_reference_weights_are_the_stage_shard_in_the_training_dtype(assumptions, width, zero_stage):
    layout = PlanLayout(tp=2, pp=2, dp=2, sp=True, zero_stage=zero_stage)
    for stage, params in enumerate(TINY_TP2_PP2_STAGE_PARAMS):
        assert stage_params_per_gpu(shape=TINY, layout=layout, stage=stage) == params
        sft = stage_memory(shape=TINY, layout=layout, training=_training(), stage=stage, assumptions=assumptions)
        dpo = stage_memory(shape=TINY, layout=layout, training=_training(BASE), stage=stage, assumptions=assumptions)
        assert dpo.reference == params * width
        # the model states are the policy's as before: the reference has no gradient and no optimizer state
        assert [getattr(dpo, c) for c in ("parameters", "gradients", "optimizer", "activations", "buffers")] == \
               [getattr(sft, c) for c in ("parameters", "gradients", "optimizer", "activations", "buffers")]
        assert dpo.total_bytes - sft.total_bytes == pytest.approx(dpo.reference * (1 + BF16.fragmentation_fraction),
                                                                  abs=1)
        assert dpo.build_peak - sft.build_peak == dpo.reference  # loaded before training, like the policy
        assert list(dpo.by_category())[:4] == ["parameters", "gradients", "optimizer", "reference"]
        assert "reference" not in sft.by_category()  # an SFT breakdown keeps its six categories


def test_zero3_does_not_partition_the_reference():
    layout = PlanLayout(tp=2, pp=1, dp=4, sp=True, zero_stage=3)
    partitioned = dataclasses.replace(BF16, zero3_persistence_threshold=0)  # the tiny tensors all persist otherwise
    dpo = stage_memory(shape=TINY, layout=layout, training=_training(BASE), stage=0, assumptions=partitioned)
    whole = stage_params_per_gpu(shape=TINY, layout=layout, stage=0)
    assert dpo.reference == whole * 2 and dpo.parameters == -(-whole // 4) * 2  # the policy's partitioned, not its


def test_a_checkpoint_path_costs_what_base_costs():
    layout = PlanLayout(tp=2, pp=2, dp=2, sp=True)
    path = stage_memory(shape=TINY, layout=layout, training=_training(DpoShape(reference="/models/ref")), stage=1,
                        assumptions=BF16)
    assert path.reference == TINY_TP2_PP2_STAGE_PARAMS[1] * 2


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_lora_and_precomputed_hold_no_reference_weights(zero_stage):
    layout = PlanLayout(tp=2, pp=1, dp=4, sp=True, zero_stage=zero_stage)
    lora = LoraShape(rank=8)
    for training in (_training(BASE, lora), _training(PRECOMPUTED), _training(PRECOMPUTED, lora)):
        sft = stage_memory(shape=TINY, layout=layout, training=dataclasses.replace(training, dpo=None), stage=0,
                           assumptions=BF16)
        dpo = stage_memory(shape=TINY, layout=layout, training=training, stage=0, assumptions=BF16)
        assert dpo.reference == 0 and dpo == dataclasses.replace(sft)  # nothing else changes either
    # LoRA against another checkpoint: those weights are not the policy's base, so a copy is held
    other = stage_memory(shape=TINY, layout=layout, training=_training(DpoShape(reference="/models/ref"), lora),
                         stage=0, assumptions=BF16)
    assert other.reference == stage_params_per_gpu(shape=TINY, layout=layout, stage=0) * 2


def test_unpacked_pairs_count_two_rows_packed_pairs_one():
    """micro_batch_size counts pairs: packed, a pair is one row of seq_length (SFT's activations at the same
    micro-batch); unpacked, two (SFT's at twice the micro-batch). The batch keeps every stage's in-flight count."""
    for recompute in ("none", "full"):
        layout = PlanLayout(tp=2, pp=2, dp=2, sp=True, micro_batch_size=1, recompute=recompute)
        double = dataclasses.replace(layout, micro_batch_size=2)
        for stage in (0, 1):
            act = {name: stage_memory(shape=TINY, layout=lay, training=_training(dpo), stage=stage,
                                      assumptions=BF16).activations
                   for name, lay, dpo in (("sft1", layout, None), ("sft2", double, None), ("packed", layout, BASE),
                                          ("unpacked", layout, DpoShape(packing=False)))}
            assert act["packed"] == act["sft1"] and act["unpacked"] == act["sft2"] > act["sft1"]


def test_reference_forward_transient_by_hand_and_below_the_policy():
    """The reference's no_grad forward (one layer's working set; on the last stage the logits, bf16 and their fp32
    upcast) runs before the policy holds anything, so it counts only where larger: it never is here."""
    layout = PlanLayout(tp=2, pp=2, dp=2, sp=True, micro_batch_size=1)
    training = _training(BASE)
    first = reference_forward_bytes(shape=TINY, layout=layout, training=training, assumptions=BF16, stage=0)
    last = reference_forward_bytes(shape=TINY, layout=layout, training=training, assumptions=BF16, stage=1)
    assert last - first == 64 * 128 * (2 + 4)  # 64 tokens x 128 vocabulary rows per rank x (bf16 + fp32)
    assert reference_forward_bytes(shape=TINY, layout=layout, training=_training(PRECOMPUTED), assumptions=BF16,
                                   stage=1) == 0
    for stage, transient in ((0, first), (1, last)):
        policy = stage_memory(shape=TINY, layout=layout, training=training, stage=stage, assumptions=BF16)
        assert transient < policy.activations


def _times(training: TrainingShape, *, layout: PlanLayout, shape=TINY, nodes=1, gpus=1):
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus, gpu=H100)
    sft = estimate_step_time(shape=shape, layout=layout, training=dataclasses.replace(training, dpo=None),
                             cluster=cluster)
    return sft, estimate_step_time(shape=shape, layout=layout, training=training, cluster=cluster)


def test_live_reference_adds_one_forward_per_micro_batch():
    """One GPU (no communication): the reference pass is a third of the policy's compute and a third of its
    memory-bound kernels (forward : backward = 1 : 2), and nothing else changes."""
    layout = PlanLayout(tp=1, pp=1, dp=1, micro_batch_size=1)
    sft, dpo = _times(_training(BASE), layout=layout)
    assert dpo.reference_s == pytest.approx(sft.compute_s / 3 + sft.elementwise_s / 3)
    assert dpo.step_time_s == pytest.approx(sft.step_time_s + dpo.reference_s)
    assert dpo.flops_per_step == pytest.approx(sft.flops_per_step * 4 / 3)  # forward + backward (3) + 1 forward
    assert dpo.hfu == pytest.approx(dpo.mfu)


def test_full_recompute_changes_the_ratio_and_precomputed_adds_nothing():
    layout = PlanLayout(tp=2, pp=2, dp=2, sp=True, micro_batch_size=1)
    sft, dpo = _times(_training(BASE), layout=layout, gpus=8)
    full_sft, full_dpo = _times(_training(BASE), layout=dataclasses.replace(layout, recompute="full"), gpus=8)
    # the same forward, a smaller share of a step that already re-runs each forward: 1/4 of the layers' FLOPs
    assert full_dpo.reference_s == pytest.approx(dpo.reference_s)
    assert 5 / 4 < full_dpo.flops_per_step / full_sft.flops_per_step < dpo.flops_per_step / sft.flops_per_step
    # a pipeline runs the reference as a forward-only pass of its own: its fill is in reference_s, not the bubble
    assert dpo.bubble_s == pytest.approx(sft.bubble_s) and dpo.reference_s > 0
    pre_sft, pre = _times(_training(PRECOMPUTED), layout=layout, gpus=8)
    assert pre.reference_s == 0 and pre.step_time_s == pytest.approx(pre_sft.step_time_s)


def test_unpacked_pairs_double_the_tokens_of_a_step():
    layout = PlanLayout(tp=1, pp=1, dp=1, micro_batch_size=1)
    _, packed = _times(_training(PRECOMPUTED), layout=layout)
    _, unpacked = _times(_training(DpoShape(reference="precomputed", packing=False)), layout=layout)
    assert unpacked.flops_per_step == pytest.approx(2 * packed.flops_per_step)
    assert unpacked.step_time_s > 1.9 * packed.step_time_s


def test_search_ranks_dpo_layouts_with_the_reference():
    shape, cluster = BUILTIN_SHAPES["llama3-8b"], Cluster(nodes=1, gpus_per_node=8, gpu=H100)
    sft = plan(shape=shape, training=TrainingShape(seq_length=4096, global_batch_size=64), cluster=cluster)
    dpo = plan(shape=shape, training=TrainingShape(seq_length=4096, global_batch_size=64, dpo=BASE), cluster=cluster)
    assert dpo.evaluated == sft.evaluated and dpo.fitting
    for candidate in dpo.fitting + dpo.rejected:
        assert all(s.reference == s.params_per_gpu * 2 for s in candidate.memory.stages)
        assert candidate.time.reference_s > 0
    assert len(dpo.fitting) < len(sft.fitting)  # the layouts that had no room for a second copy drop out


def test_search_proposes_no_context_parallelism_for_dpo():
    """At 16k tokens the SFT search takes CP layouts; DPO's are refused by `dsmt check` (dpo_context_parallel), so
    the planner never proposes them, and --explain of one names the rule."""
    from toolkit.plan.search import layout_violations

    shape, cluster = BUILTIN_SHAPES["llama3-70b"], Cluster(nodes=4, gpus_per_node=8, gpu=H100)
    sft = plan(shape=shape, training=TrainingShape(seq_length=16384, global_batch_size=64), cluster=cluster)
    training = TrainingShape(seq_length=16384, global_batch_size=64, dpo=BASE)
    dpo = plan(shape=shape, training=training, cluster=cluster)
    assert any(c.layout.cp > 1 for c in sft.fitting + sft.rejected)
    assert dpo.fitting and not any(c.layout.cp > 1 for c in dpo.fitting + dpo.rejected)
    layout = PlanLayout(tp=4, pp=4, cp=2, dp=1, sp=True, zero_stage=1, micro_batch_size=1)
    assert any("dpo_context_parallel" in v for v in layout_violations(shape=shape, layout=layout, training=training,
                                                                       cluster=cluster))


def test_report_names_the_reference():
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu=H100)
    training = TrainingShape(seq_length=4096, global_batch_size=64, dpo=BASE)
    result = plan(shape=BUILTIN_SHAPES["llama3-8b"], training=training, cluster=cluster)
    text = format_table(result, top=3)
    assert "reference weights" in text and "reference forward" in text and "+ ref +" in text
    found = plan_dict(result, top=3)
    assert found["training"]["dpo"] == {"reference": "base", "packing": True}
    assert found["layouts"][0]["memory_breakdown_gb"]["reference"] > 0
    assert "reference_forward" in found["layouts"][0]["step_breakdown_s"]
    layout = PlanLayout(tp=2, pp=1, dp=4, sp=True, micro_batch_size=1)
    why = explain(shape=result.shape, layout=layout, training=training, cluster=cluster, result=result)
    assert "reference " in why and "reference weights" in why and "reference forward" in why


def test_an_sft_report_says_nothing_of_a_reference():
    result = plan(shape=BUILTIN_SHAPES["llama3-8b"], training=TrainingShape(seq_length=4096, global_batch_size=64),
                  cluster=Cluster(nodes=1, gpus_per_node=8, gpu=H100))
    assert "reference" not in format_table(result, top=3)
    assert "reference_forward" not in plan_dict(result, top=1)["layouts"][0]["step_breakdown_s"]


def test_cli_plans_dpo(capsys):
    base = ["plan", "llama3-8b", "--nodes", "1", "--seq-len", "2048", "--global-batch", "64", "--json"]
    assert main(base + ["--dpo", "base", "--dpo-unpacked"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["training"]["dpo"] == {"reference": "base", "packing": False}
    assert main(base + ["--dpo-unpacked"]) == 2
    assert "give --dpo REFERENCE" in capsys.readouterr().err


def test_emitted_spec_is_a_dpo_spec(tmp_path, capsys):
    from toolkit.spec.load import load_spec

    path = tmp_path / "dpo.yaml"
    assert main(["plan", "llama3-8b", "--nodes", "1", "--seq-len", "2048", "--global-batch", "64", "--dpo",
                 "precomputed", "--dpo-unpacked", "--emit-spec", str(path)]) == 0
    spec = load_spec(path)
    assert dpo_shape_of(spec) == DpoShape(reference="precomputed", packing=False)
    assert spec.data.type == "preference" and "set data.path" in capsys.readouterr().err


def test_the_example_config_is_dpo_with_lora():
    """configs/templates/dpo-llama3-8b-tp2-lora.yaml as the planner reads it: no reference weights, one row per pair."""
    from toolkit.check.checks import planner_inputs
    from toolkit.spec.load import load_spec

    spec = load_spec(CONFIG)
    assert dpo_shape_of(spec) == DpoShape(reference="base", packing=True)
    layout, training, gpu, assumptions = planner_inputs(spec)
    # planner_inputs reads LoRA's targets from the checkpoint's family (model.path is a placeholder here): every
    # projection of attention and MLP, dsmt's default for a Llama
    training = dataclasses.replace(training, lora=LoraShape(rank=spec.training.lora.rank), dpo=dpo_shape_of(spec))
    assert (layout.tp, layout.dp, layout.micro_batch_size) == (2, 4, 2)
    memory = estimate_memory(shape=BUILTIN_SHAPES["llama3-8b"], layout=layout, training=training, gpu=gpu,
                             assumptions=assumptions)
    assert memory.fits and memory.worst.reference == 0


LLAMA70_COMMAND = ("dsmt plan llama3-70b --nodes 4 --gpus-per-node 8 --gpu h100-80gb --seq-len 4096 --global-batch 64 "
                   "--dpo base{lora} --explain \"tp=8 pp=4 zero=1 mbs=1 recompute=none\"")


def test_llama3_70b_dpo_on_4x8_h100(capsys):
    """Llama-3-70B DPO, 4 nodes x 8 H100, TP 8 x PP 4 (dp 1), bf16, ZeRO-1, micro-batch 1 pair (packed), seq 4096,
    64 pairs per step, reference base: full fine-tuning holds a 4.5 GB frozen copy per GPU, LoRA none."""
    shape, cluster = BUILTIN_SHAPES["llama3-70b"], Cluster(nodes=4, gpus_per_node=8, gpu=H100)
    layout = PlanLayout(tp=8, pp=4, dp=1, sp=True, zero_stage=1, micro_batch_size=1)
    lines = []
    for name, lora in (("full fine-tuning", None), ("LoRA rank 16", LoraShape(rank=16))):
        training = TrainingShape(seq_length=4096, global_batch_size=64, lora=lora, dpo=BASE)
        memory = estimate_memory(shape=shape, layout=layout, training=training, gpu=H100)
        time = estimate_step_time(shape=shape, layout=layout, training=training, cluster=cluster)
        params = stage_params_per_gpu(shape=shape, layout=layout, stage=memory.worst.stage)
        assert memory.fits and memory.worst.reference == (params * 2 if lora is None else 0)
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in memory.by_category().items())
        lines.append(f"{name}: {memory.total_bytes / 1e9:.1f} GB per GPU on stage {memory.worst.stage} ({parts} GB); "
                     f"step {time.step_time_s:.2f} s, of which reference forward {time.reference_s:.2f} s; "
                     f"reproduce: {LLAMA70_COMMAND.format(lora=' --lora-rank 16' if lora else '')}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.parametrize("method", ["simpo", "orpo"])
def test_reference_free_methods_hold_no_reference_and_run_no_extra_forward(method):
    from toolkit.spec.load import validate_spec

    spec = validate_spec({"model": {"builtin": "llama3-8b"}, "data": {"path": "pairs.jsonl", "type": "preference"},
                          "training": {"method": method, "global_batch_size": 64}}, source="test")
    shape = dpo_shape_of(spec)
    assert shape == DpoShape(reference="none", packing=True) and not shape.live_reference
    training = TrainingShape(seq_length=4096, global_batch_size=64, dpo=shape)
    layout = PlanLayout(tp=2, pp=1, dp=4, sp=True, zero_stage=1, micro_batch_size=1)
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu=H100)
    memory = estimate_memory(shape=BUILTIN_SHAPES["llama3-8b"], layout=layout, training=training, gpu=H100)
    time = estimate_step_time(shape=BUILTIN_SHAPES["llama3-8b"], layout=layout, training=training, cluster=cluster)
    assert memory.worst.reference == 0 and time.reference_s == 0
