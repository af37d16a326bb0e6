"""The planner on mixture-of-experts models: expert weights per rank, ZeRO over expert_dp, routed activations and
FLOPs, the token all-to-all, the router-imbalance assumption, ep in the search and the `dsmt plan` output.

The figures are computed by hand from toolkit/plan/experts.py's formulas (written out in each test)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from toolkit.cli import main
from toolkit.plan.activations import activation_bytes_per_layer
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import estimate_memory, stage_params_per_gpu
from toolkit.plan.timing import estimate_step_time, layer_forward_flops
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape

H100 = get_gpu("h100-80gb")
MIXTRAL = BUILTIN_SHAPES["mixtral-8x7b"]
# h 64, 4 layers, 8 heads of 8 / 2 KV heads, vocab 250 (padded to 256), 8 SwiGLU experts of width 32, top-2.
SMALL_MOE = ModelShape("small-moe", 64, 4, 8, 2, 96, 250, False, True, 128,
                       num_experts=8, moe_topk=2, moe_ffn_hidden_size=32)
MIXTRAL_ARGS = ["plan", "mixtral-8x7b", "--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100-80gb",
                "--seq-len", "4096", "--global-batch", "512"]


def _memory(layout, *, shape=SMALL_MOE, seq=128, batch=64, **assume):
    return estimate_memory(shape=shape, layout=layout, training=TrainingShape(seq, batch), gpu=H100,
                           assumptions=Assumptions(**assume))


def _step(layout, *, nodes=2, shape=MIXTRAL, seq=4096, batch=64, **assume):
    cluster = Cluster(nodes=nodes, gpus_per_node=8, gpu=H100)
    return estimate_step_time(shape=shape, layout=layout, training=TrainingShape(seq, batch), cluster=cluster,
                              assumptions=Assumptions(**assume))


def test_expert_params_per_rank_fall_by_ep_and_the_dense_part_does_not():
    # tp=2, per layer: qkv 64·(4 + 2·1)·8 = 3072, proj 4·8·64 = 2048, router 8·64 = 512, two norms 128
    dense = 4 * (3072 + 2048 + 512 + 128) + 2 * (256 // 2 * 64) + 64  # + embedding, output layer, final norm
    one_expert = 64 * 16 * 2 + 16 * 64  # fc1 (gate and up) and fc2 at width 32 / tp
    for ep in (1, 2, 4, 8):
        layout = PlanLayout(tp=2, pp=1, dp=8, ep=ep, sp=True)
        memory = _memory(layout)
        experts = 4 * (8 // ep) * one_expert
        assert memory.expert_params_per_gpu == experts
        assert memory.params_per_gpu == stage_params_per_gpu(shape=SMALL_MOE, layout=layout, stage=0) == \
            dense + experts


def test_whole_model_matches_the_shape_count():
    """At tp = ep = pp = 1 a rank holds the whole model (vocabulary 32000: a multiple of 128, no padding rows)."""
    held = stage_params_per_gpu(shape=MIXTRAL, layout=PlanLayout(tp=1, pp=1, dp=8), stage=0)
    assert held == MIXTRAL.num_params()
    assert MIXTRAL.num_params() == pytest.approx(46.7e9, rel=1e-3)  # Mixtral's published 46.7 B


def test_zero1_expert_states_are_partitioned_over_expert_dp():
    """bf16 ZeRO-1 at tp=1, dp=8, ep=4 (expert_dp 2): fp32 master + Adam (12 bytes) over the dense parameters /
    dp × cp and the experts / expert_dp; weights (2 bytes) and the fp32 gradient buffer (4 bytes) whole."""
    # per layer: qkv 64·(8 + 2·2)·8 = 6144, proj 8·8·64 = 4096, router 512, norms 128; embedding and output layer
    # 256·64 each, final norm 64
    dense = 4 * (6144 + 4096 + 512 + 128) + 2 * 256 * 64 + 64
    experts = 4 * (8 // 4) * (64 * 32 * 2 + 32 * 64)
    assert (dense, experts) == (76352, 49152)
    memory = _memory(PlanLayout(tp=1, pp=1, dp=8, ep=4, zero_stage=1))
    assert memory.optimizer == 12 * (dense // 8 + experts // 2) == 409440
    assert memory.gradients == 4 * (dense + experts)
    assert memory.parameters == 2 * (dense + experts)
    # partitioned over all 8 data-parallel ranks, the experts' states would be 4x smaller
    assert memory.optimizer != 12 * (dense // 8 + experts // 8)


def test_routed_activations_per_layer():
    """te layers, fused attention, tp = 1, s = 128, b = 1, per token: norms 2·ab·h + linear inputs 2·ab·h + router
    probabilities 4E = 544; q, k, v ab·(8 + 2·2)·8 = 192, projection input ab·8·8 = 128, fp32 LSE 4·8 = 32, and
    k = 2 routed copies of (expert input ab·h + SwiGLU 3·ab·32) = 640; per micro-batch RoPE 4·s·d·ab."""
    per_layer = activation_bytes_per_layer(shape=SMALL_MOE, seq_length=128, micro_batch_size=1, tp=1,
                                           sequence_parallel=False, recompute="none")
    assert per_layer == 128 * 544 + 128 * (192 + 128 + 32 + 640) + 4 * 128 * 8 * 2 == 204800
    busiest = activation_bytes_per_layer(shape=SMALL_MOE, seq_length=128, micro_batch_size=1, tp=1,
                                         sequence_parallel=False, recompute="none", ep=2,
                                         assumptions=Assumptions(router_imbalance=2.0))
    assert busiest - per_layer == 128 * 640  # twice the routed copies on the busiest EP rank


def test_flops_count_the_top_k_experts_not_all():
    h, f, d = 4096, 14336, 128
    attention = h * d * (32 + 2 * 8) + 32 * d * h
    router = 8 * h
    routed = 2 * 3 * h * f  # top-2 SwiGLU experts
    matmul, _ = layer_forward_flops(shape=MIXTRAL, tokens=1, seq_length=4096)
    assert matmul == 2.0 * (attention + router + routed) == 788_594_688
    all_experts = 2.0 * (attention + router + 8 * 3 * h * f)
    assert matmul < all_experts / 3
    # 12.9 B active parameters per token (Mistral's figure): the layers' active weights and the embeddings
    assert 32 * (attention + router + routed) + 2 * 32000 * h == pytest.approx(12.9e9, rel=0.01)


@pytest.mark.parametrize("tp, ep, nodes, link_gbps", [(1, 2, 2, 450.0), (1, 8, 2, 450.0), (2, 8, 2, 50.0)])
def test_all_to_all_bytes_over_the_link(tp, ep, nodes, link_gbps):
    """4 all-to-alls per layer and micro-batch, each T' · k · h · 2 bytes · (ep-1)/ep per rank (T' = s / tp under
    sequence parallelism); NVLink when the ep × tp ranks fit in a node (8 GPUs), else the GPU's NIC."""
    layout = PlanLayout(tp=tp, pp=1, dp=16 // tp, ep=ep, sp=tp > 1, zero_stage=1)
    one_bytes = 4096 // tp * 2 * 4096 * 2 * (ep - 1) / ep
    one_s = one_bytes / (link_gbps * 1e9 * 0.8) + Assumptions().collective_latency_s
    micro_batches = 64 // layout.dp
    assert _step(layout, nodes=nodes).ep_comm_s == pytest.approx(micro_batches * 32 * 4 * one_s, rel=1e-12)


def test_all_to_all_is_zero_without_expert_parallelism():
    assert _step(PlanLayout(tp=1, pp=1, dp=16, ep=1, zero_stage=1)).ep_comm_s == 0.0
    dense = BUILTIN_SHAPES["llama3-8b"]
    assert _step(PlanLayout(tp=1, pp=1, dp=16, zero_stage=1), shape=dense).ep_comm_s == 0.0


def test_router_imbalance_raises_the_expert_compute_and_nothing_else():
    layout = PlanLayout(tp=1, pp=1, dp=16, ep=8, zero_stage=1)
    balanced, skewed = _step(layout), _step(layout, router_imbalance=2.0)
    # one extra mean's worth of expert FLOPs on the busiest rank: 2 · T · k·3·h·f per layer, 3 passes
    extra_flops = 4 * 32 * 3 * 2.0 * 4096 * (2 * 3 * 4096 * 14336)  # micro-batches × layers × passes × FLOPs
    assert skewed.compute_s - balanced.compute_s == pytest.approx(extra_flops / (989e12 * get_gpu("h100-80gb").matmul_efficiency), rel=1e-9)
    changed = {f.name for f in dataclasses.fields(balanced) if getattr(balanced, f.name) != getattr(skewed, f.name)}
    assert changed == {"compute_s", "step_time_s", "tokens_per_s", "mfu"}
    assert skewed.flops_per_step == balanced.flops_per_step  # the model's work is the same, the wait is longer
    # at ep = 1 every rank holds every expert: routing cannot unbalance the ranks
    whole = PlanLayout(tp=1, pp=1, dp=16, ep=1, zero_stage=1)
    assert _step(whole, router_imbalance=2.0) == _step(whole)


def test_router_imbalance_below_one_is_refused(capsys):
    assert main(MIXTRAL_ARGS + ["--router-imbalance", "0.5"]) == 2
    assert "router_imbalance=0.5 is below 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mixtral_json():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(MIXTRAL_ARGS + ["--json", "--top", "1000"]) == 0
    return json.loads(out.getvalue())


def test_plan_searches_ep_for_an_moe_model(mixtral_json):
    layouts = mixtral_json["layouts"]
    eps = {x["ep"] for x in layouts}
    assert eps >= {1, 2, 4, 8} and all(x["tp"] == 1 or x["sequence_parallel"] for x in layouts)
    assert all(x["zero_stage"] < 3 for x in layouts if x["ep"] > 1)  # zero3_with_ep
    assert all("ep_all_to_all" in x["step_breakdown_s"] for x in layouts)
    assert all(sum(x["step_breakdown_s"].values()) == pytest.approx(x["step_time_s"], abs=2e-3) for x in layouts)
    assert mixtral_json["moe"] == {"num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 14336,
                                   "router_imbalance": 1.0}
    for x in layouts:
        ep, tp, pp = x["ep"], x["tp"], x["pp"]
        assert x["expert_params_per_gpu"] == 32 // pp * (8 // ep) * 3 * 4096 * 14336 // tp


def test_plan_text_and_explain_name_ep_the_all_to_all_and_router_imbalance(capsys):
    assert main(MIXTRAL_ARGS + ["--top", "20"]) == 0
    table = capsys.readouterr().out
    assert "router_imbalance = 1.0" in table and " ep " in table.splitlines()[4]
    assert "B of them experts" in table
    assert main(MIXTRAL_ARGS + ["--router-imbalance", "1.3", "--explain", "tp=2 pp=2 ep=4 zero=1 mbs=1"]) == 0
    explained = capsys.readouterr().out
    assert "layout tp=2 pp=2 ep=4 dp=8 zero=1" in explained and "FITS" in explained
    assert "router_imbalance = 1.3" in explained and "ep all to all" in explained and "all-to-all" in explained
    assert "B experts)" in explained


def test_emitted_spec_carries_ep(tmp_path, capsys):
    import yaml

    fastest_only = MIXTRAL_ARGS + ["--time-uncertainty", "0"]
    assert main(fastest_only + ["--json", "--top", "1"]) == 0
    best_ep = json.loads(capsys.readouterr().out)["layouts"][0]["ep"]
    path = tmp_path / "job.yaml"
    assert main(fastest_only + ["--emit-spec", str(path)]) == 0
    assert best_ep > 1 and yaml.safe_load(path.read_text())["parallel"]["ep"] == best_ep


def test_dense_plan_output_has_no_moe_fields(capsys):
    assert main(["plan", "llama3-8b", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "4096",
                 "--global-batch", "64", "--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "moe" not in data and all("ep" not in x and "ep_all_to_all" not in x["step_breakdown_s"]
                                     for x in data["layouts"])


def test_an_ep_the_arithmetic_cannot_use_is_an_error():
    from toolkit.errors import DsmtError

    with pytest.raises(DsmtError, match=r"ep=3 must divide num_experts=8 and dp×cp=8×1=8; valid ep: 1, 2, 4, 8"):
        _memory(PlanLayout(tp=1, pp=1, dp=8, ep=3))
    with pytest.raises(DsmtError, match="valid ep: 1$"):
        _memory(PlanLayout(tp=1, pp=1, dp=8, ep=2), shape=BUILTIN_SHAPES["tiny-llama"])
