"""The one layout rule set: its messages, and every front end (check, generate, plan, trainer/verify) accepting or
refusing the same layouts for the same reason."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from toolkit.parallel.layout import Layout
from toolkit.parallel.rules import (LAYOUT_RULES, MODEL_RULES, ModelFacts, RunFacts, layout_problems,
                                    require_valid_layout)
from toolkit.parallel.groups import LayoutError

# 12 heads, 2 KV heads: tp 4, 6 and 12 replicate each KV head on tp/2 ranks (megatron-core allows it); a vocabulary
# of 1152 = 9 × 128 is divisible by every tp that divides the heads.
HF = {"hidden_size": 96, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 2,
      "intermediate_size": 192, "vocab_size": 1152, "hidden_act": "silu", "max_position_embeddings": 4096}
MODEL = ModelFacts(num_attention_heads=12, num_kv_heads=2, ffn_hidden_size=192, num_layers=4, padded_vocab_size=1152)
# The same shape as a Mixtral of 8 experts, top-2 (rows with "moe": True use it).
MOE_HF = {**HF, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}


def run_facts(**overrides) -> RunFacts:
    values = dict(world_size=24, gpus_per_node=12, global_batch_size=48, micro_batch_size=1, seq_length=2048,
                  zero_stage=1, device="cuda", attention="fused")
    return RunFacts(**{**values, **overrides})


def rules_of(problems, severity="error") -> set[str]:
    return {p.rule for p in problems if p.severity == severity}


def test_messages_name_values_and_valid_choices():
    problems = layout_problems(layout=Layout(tp=5, dp=1), model=MODEL)
    assert rules_of(problems) == {"heads_vs_tp", "kv_heads_vs_tp", "ffn_vs_tp", "vocab_padding"}
    problem = problems[0]
    assert problem.rule == "heads_vs_tp" and "tp=5 does not divide num_attention_heads=12" in problem.message
    assert problem.valid == (1, 2, 4, 6, 12) and "valid tp: 1, 2, 4, 6, 12" in problem.fix
    (problem,) = layout_problems(layout=Layout(tp=3), model=MODEL)
    assert problem.rule == "kv_heads_vs_tp" and "num_kv_heads=2" in problem.message
    (problem,) = layout_problems(layout=Layout(pp=3), model=MODEL)
    assert problem.rule == "layers_vs_pp" and problem.valid == (1, 2, 4) and "pp×vpp=3×1=3" in problem.message
    assert rules_of(layout_problems(layout=Layout(tp=0), model=MODEL)) == {"layout_sizes"}
    with pytest.raises(LayoutError, match=r"\[vpp_needs_pp\] vpp=2 needs pp > 1"):
        require_valid_layout(layout=Layout(vpp=2), model=MODEL)


def test_kv_head_replication_is_valid():
    assert layout_problems(layout=Layout(tp=6, dp=4), model=MODEL, run=run_facts(gpus_per_node=6)) == []
    assert layout_problems(layout=Layout(tp=4, dp=6), model=MODEL, run=run_facts()) == []
    assert layout_problems(layout=Layout(tp=12, dp=2), model=MODEL, run=run_facts()) == []


def test_tp_group_across_nodes_warns_with_the_in_node_choice():
    (problem,) = layout_problems(layout=Layout(tp=6, dp=2, pp=2), model=MODEL, run=run_facts(gpus_per_node=8))
    assert (problem.severity, problem.rule) == ("warning", "tp_crosses_nodes")
    assert problem.valid == (1, 2, 4) and "largest: 4" in problem.fix  # 8 % 6 != 0: a TP group of 6 straddles nodes


def test_context_parallel_rules():
    layout = Layout(cp=2, dp=12)
    assert layout_problems(layout=layout, model=MODEL, run=run_facts()) == []
    assert rules_of(layout_problems(layout=layout, model=MODEL, run=run_facts(device="cpu", attention="local"))) == \
        {"cp_on_cpu"}
    assert rules_of(layout_problems(layout=Layout(dp=24), model=MODEL, run=run_facts(device="cpu"))) == \
        {"fused_attention_on_cpu"}
    assert rules_of(layout_problems(layout=layout, model=MODEL, run=run_facts(attention="local"))) == \
        {"cp_needs_fused_attention"}
    (problem,) = layout_problems(layout=layout, model=MODEL, run=run_facts(seq_length=2050))
    assert problem.rule == "cp_vs_seq_length" and "2×cp=4" in problem.message
    (problem,) = layout_problems(layout=layout, model=dataclasses.replace(MODEL, mla=True), run=run_facts())
    assert problem.rule == "cp_with_mla" and problem.valid == (1,)


def test_every_mlp_width_must_divide_by_tp():
    """DeepSeek's dense layers (intermediate_size), routed and shared experts are three widths TP splits."""
    model = dataclasses.replace(MODEL, other_ffn_sizes=(("moe_intermediate_size", 30), ("shared experts", 72)))
    (problem,) = layout_problems(layout=Layout(tp=4, dp=6), model=model, run=run_facts())
    assert (problem.rule, problem.message) == ("ffn_vs_tp", "tp=4 does not divide the moe_intermediate_size width 30")
    assert 4 not in problem.valid and 2 in problem.valid and 6 in problem.valid
    assert layout_problems(layout=Layout(tp=2, dp=12), model=model, run=run_facts()) == []


# One row: the spec's parallel / training / cluster values and the error rules every front end must report.
TABLE = [
    ({"tp": 2}, set()),
    ({"tp": 6}, set()),  # KV heads replicated
    ({"tp": 2, "sequence_parallel": True}, set()),
    ({"tp": 1, "sequence_parallel": True}, {"sequence_parallel_needs_tp"}),
    ({"tp": 4}, set()),  # KV heads replicated
    ({"tp": 3}, {"kv_heads_vs_tp"}),
    ({"tp": 5}, {"world_size", "heads_vs_tp", "kv_heads_vs_tp", "ffn_vs_tp", "vocab_padding"}),
    ({"tp": 8}, {"heads_vs_tp"}),
    ({"pp": 3}, {"layers_vs_pp"}),
    ({"pp": 2, "vpp": 2}, set()),
    ({"pp": 2, "vpp": 4}, {"layers_vs_pp"}),
    ({"tp": 2, "pp": 2, "vpp": 2, "gbs": 18}, {"vpp_microbatches"}),  # 18 / (1 × dp 6) = 3 micro-batches, pp 2
    ({"vpp": 2}, {"vpp_needs_pp"}),
    ({"pp": 2, "zero_stage": 2}, {"zero_with_pp"}),
    ({"zero_stage": 3}, set()),
    ({"tp": 2, "mbs": 5}, {"batch_divisibility"}),
    ({"cp": 2}, set()),
    ({"cp": 2, "attention": "local"}, {"cp_needs_fused_attention"}),
    ({"cp": 2, "seq_length": 2050}, {"cp_vs_seq_length"}),
    ({"cp": 5}, {"world_size", "cp_vs_seq_length"}),
    ({"tp": 4, "sequence_parallel": True, "seq_length": 2046}, {"sequence_parallel_vs_seq_length"}),
    ({"tp": 2, "cp": 2, "sequence_parallel": True, "seq_length": 2044}, set()),
    ({"tp": 4, "cp": 2, "sequence_parallel": True, "seq_length": 2044}, {"sequence_parallel_vs_seq_length"}),
    ({"ep": 2}, {"ep_needs_experts"}),  # a dense model
    ({"moe": True, "ep": 2}, set()),
    ({"moe": True, "ep": 4, "tp": 2, "sequence_parallel": True}, set()),  # dp 12 = ep 4 x expert-dp 3
    ({"moe": True, "ep": 3}, {"experts_vs_ep"}),  # dp 24 is a multiple of 3; 8 experts are not
    ({"moe": True, "ep": 8, "tp": 4, "sequence_parallel": True}, {"ep_vs_data_parallel"}),  # dp 6
    ({"moe": True, "tp": 2}, {"moe_tp_needs_sequence_parallel"}),
    ({"moe": True, "ep": 2, "zero_stage": 3}, {"zero3_with_ep"}),
]


def test_every_rule_is_reachable_from_the_table_or_the_unit_tests():
    tabled = set().union(*(expected for _, expected in TABLE))
    unit = {"layout_sizes", "cp_on_cpu", "fused_attention_on_cpu", "tp_crosses_nodes", "attention_softcap_needs_local",
            "cp_with_mla", "local_layers_only"}
    assert LAYOUT_RULES == tabled | unit
    assert MODEL_RULES == LAYOUT_RULES - RUN_RULES  # what the model loader (and the dry run's build) can decide


def test_expert_parallel_errors_list_the_valid_ep():
    moe = dataclasses.replace(MODEL, num_experts=8)
    (problem,) = layout_problems(layout=Layout(ep=3, dp=6), model=moe)
    assert problem.rule == "experts_vs_ep" and "ep=3 does not divide num_experts=8" in problem.message
    assert problem.valid == (1, 2) and "valid ep: 1, 2" in problem.fix  # divisors of 8 that divide dp 6
    (problem,) = layout_problems(layout=Layout(ep=4, dp=2), model=moe)
    assert problem.rule == "ep_vs_data_parallel" and "dp×cp=2×1=2" in problem.message and problem.valid == (1, 2)


def spec_of(row: dict) -> dict:
    parallel = {k: row[k] for k in ("tp", "pp", "vpp", "cp", "ep", "sequence_parallel", "zero_stage") if k in row}
    return {
        "model": {"config": copy.deepcopy(MOE_HF if row.get("moe") else HF)},
        "cluster": {"nodes": 2, "gpus_per_node": 12, "gpu": "h100-80gb", "hosts": ["node-a", "node-b"]},
        "parallel": parallel,
        "training": {"global_batch_size": row.get("gbs", 48), "micro_batch_size": row.get("mbs", 1),
                     "seq_length": row.get("seq_length", 2048), "precision": "bf16",
                     "attention": row.get("attention", "auto"), "train_steps": 10, "warmup_steps": 1},
        "data": {"synthetic": True},
    }


def check_rules(row: dict) -> set[str]:
    from toolkit.check.checks import run_checks
    from toolkit.spec.load import validate_spec

    report = run_checks(spec=validate_spec(spec_of(row), source="row"))
    return report.rules("error") & LAYOUT_RULES


def plan_rules(row: dict) -> set[str]:
    from toolkit.plan.assumptions import Assumptions
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
    from toolkit.plan.search import layout_violations
    from toolkit.adapters.model_shape import shape_from_config

    shape = shape_from_config(MOE_HF if row.get("moe") else HF, name="row")
    tp, pp, cp = row.get("tp", 1), row.get("pp", 1), row.get("cp", 1)
    layout = PlanLayout(tp=tp, pp=pp, vpp=row.get("vpp", 1), cp=cp, ep=row.get("ep", 1),
                        sp=row.get("sequence_parallel", False),
                        dp=max(1, 24 // (tp * pp * cp)), zero_stage=row.get("zero_stage", 1),
                        micro_batch_size=row.get("mbs", 1))
    training = TrainingShape(seq_length=row.get("seq_length", 2048), global_batch_size=row.get("gbs", 48))
    assumptions = Assumptions()
    if row.get("attention") == "local":
        assumptions = dataclasses.replace(assumptions, attention="local")
    found = layout_violations(shape=shape, layout=layout, training=training, assumptions=assumptions,
                              cluster=Cluster(nodes=2, gpus_per_node=12, gpu=get_gpu("h100-80gb")))
    return {text[1:text.index("]")] for text in found if text.startswith("[")}


def trainer_rules(row: dict) -> set[str]:
    """What the model loader (`dsmt train`'s ranks, `dsmt verify`) refuses: the model-side rules, no run facts."""
    import transformers

    from toolkit.convert.chunks import check_layout

    config = transformers.MixtralConfig(**MOE_HF) if row.get("moe") else transformers.LlamaConfig(**HF)
    tp, pp, cp = row.get("tp", 1), row.get("pp", 1), row.get("cp", 1)
    layout = Layout(tp=tp, pp=pp, vpp=row.get("vpp", 1), cp=cp, ep=row.get("ep", 1), dp=max(1, 24 // (tp * pp * cp)),
                    sp=row.get("sequence_parallel", False))
    try:
        check_layout(hf_config=config, layout=layout)
    except LayoutError as err:
        return {rule for rule in LAYOUT_RULES if f"[{rule}]" in str(err)}
    return set()


# The rules that need the world, batch or device: the model loader cannot see them.
RUN_RULES = {"world_size", "batch_divisibility", "vpp_microbatches", "zero_with_pp", "cp_on_cpu", "fused_attention_on_cpu",
             "cp_with_mla",
             "sequence_parallel_vs_seq_length",
             "cp_needs_fused_attention", "cp_vs_seq_length", "tp_crosses_nodes", "moe_tp_needs_sequence_parallel",
             "zero3_with_ep", "attention_softcap_needs_local", "local_layers_only"}


@pytest.mark.parametrize("row,expected", TABLE, ids=[str(row) for row, _ in TABLE])
def test_every_front_end_accepts_or_refuses_alike(row, expected):
    assert check_rules(row) == expected
    assert plan_rules(row) == expected
    assert trainer_rules(row) == expected - RUN_RULES


def test_planner_never_proposes_a_tp_group_across_nodes():
    """tp=6 divides this model's heads (KV heads replicated) but not an 8-GPU node: a TP group of 6 would straddle
    two nodes, so the search leaves it out (as it leaves out tp=12 > 8); `dsmt check` only warns about it."""
    from toolkit.plan.hardware import get_gpu
    from toolkit.plan.layout import Cluster, TrainingShape
    from toolkit.plan.search import enumerate_layouts
    from toolkit.adapters.model_shape import shape_from_config

    cluster = Cluster(nodes=3, gpus_per_node=8, gpu=get_gpu("h100-80gb"))
    layouts = list(enumerate_layouts(shape=shape_from_config(HF, name="row"), cluster=cluster,
                                     training=TrainingShape(seq_length=2048, global_batch_size=48)))
    assert layouts and {layout.tp for layout in layouts} == {1, 2, 4}
