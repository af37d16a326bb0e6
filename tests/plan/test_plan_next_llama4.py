"""The planner on Qwen3-Next and Llama 4 (issue 49): parameter counts equal transformers' models layer by layer
(Qwen3-Next's Gated DeltaNet and gated attention layers, Llama 4's interleaved MoE with a shared expert), read from
the configs transformers' own classes write (Llama 4's multimodal config through its text_config); the per-rank
tensors; FLOPs linear in s on Gated DeltaNet layers and capped at the chunk on chunked attention; the TP rule on
Gated DeltaNet heads; and the published totals of Qwen3-Next-80B-A3B and Llama 4 Scout / Maverick."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.adapters.model_shape import load_model_shape
from toolkit.models.mixer_shapes import ATTENTION, CHUNKED, LINEAR, MIXER_DEFAULTS
from toolkit.models.shapes import BUILTIN_SHAPES, shape_from_fields
from toolkit.parallel.layout import Layout
from toolkit.parallel.rules import ModelFacts, layout_problems
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layers import layer_tensors, representative_stages
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import estimate_memory, stage_params_per_gpu
from toolkit.plan.timing import estimate_step_time, layer_forward_flops, training_flops

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24)
QWEN3_NEXT = BUILTIN_SHAPES["qwen3-next-80b-a3b"]
SCOUT, MAVERICK = BUILTIN_SHAPES["llama4-scout-17b-16e"], BUILTIN_SHAPES["llama4-maverick-17b-128e"]


def _tiny_configs():
    import transformers

    text = dict(SMALL, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
                interleave_moe_layer_step=2, attention_chunk_size=16)
    return {
        # 2 key / 4 value heads of 16 / 12, layer 1 dense (mlp_only_layers), layers 0-2 Gated DeltaNet
        "qwen3_next": transformers.Qwen3NextConfig(
            **SMALL, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[1]),
        "llama4_text": transformers.Llama4TextConfig(**text),
        "llama4": transformers.Llama4Config(text_config=text),
    }


def _language_model(config):
    import torch
    import transformers

    with torch.device("meta"):  # shapes only: no initialisation
        if config.model_type == "llama4":
            return transformers.Llama4ForConditionalGeneration(config).language_model
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["qwen3_next", "llama4_text", "llama4"])
def test_param_count_equals_the_hf_model(name, tmp_path):
    config = _tiny_configs()[name]
    config.save_pretrained(tmp_path)
    shape = load_model_shape(tmp_path)
    model = _language_model(config)
    for i, layer in enumerate(model.model.layers):
        mixer = layer.linear_attn if shape.layer_mixer(i) == LINEAR else layer.self_attn
        assert sum(p.numel() for p in mixer.parameters()) == shape.mixer_params(shape.layer_mixer(i)), i
        mlp = layer.mlp if name == "qwen3_next" else layer.feed_forward
        assert sum(p.numel() for p in mlp.parameters()) == shape.mlp_params(moe=shape.is_moe_layer(i)), i
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    assert stage_params_per_gpu(shape=shape, layout=PlanLayout(tp=1, pp=1, dp=4), stage=0) == shape.num_params()


def test_layer_kinds_read_from_the_configs():
    configs = _tiny_configs()
    next_shape = shape_from_fields(configs["qwen3_next"].to_dict(), name="n", gated_mlp=True, kv_heads_replicable=True)
    assert [next_shape.layer_mixer(i) for i in range(4)] == [LINEAR, LINEAR, LINEAR, ATTENTION]
    assert (next_shape.dense_layers, next_shape.rope_dim, next_shape.moe_topk) == ((1,), 6, 2)  # 24 x 0.25
    # Llama 4: MoE on layers 1, 3 ((i + 1) % 2 == 0); chunked attention on the RoPE layers 0-2
    outer = configs["llama4"].to_dict()  # read without the multimodal wrapper too: its text_config
    for config in (configs["llama4_text"].to_dict(), outer):
        shape = shape_from_fields(config, name="l", gated_mlp=True, kv_heads_replicable=True)
        assert (shape.dense_layers, shape.ffn_hidden_size, shape.moe_ffn_hidden_size) == ((0, 2), 96, 32)
        assert [shape.layer_mixer(i) for i in range(4)] == [CHUNKED, CHUNKED, CHUNKED, ATTENTION]


def test_defaults_are_transformers():
    import transformers

    classes = {"qwen3_next": transformers.Qwen3NextConfig, "llama4_text": transformers.Llama4TextConfig}
    for model_type, defaults in MIXER_DEFAULTS.items():
        config = classes[model_type]()
        assert {k: getattr(config, k) for k in defaults} == defaults


def test_per_rank_tensors_at_tp_2():
    """Qwen3-Next at tp 2: a Gated DeltaNet's projections and per-head A_log / dt_bias halved, its conv kernel and
    gated norm whole; the gated attention's linear_qkv with a gate row per query row, the q / k norms whole."""
    gdn = layer_tensors(shape=QWEN3_NEXT, tp=2, moe=True, mixer=LINEAR)
    h = 2048
    assert gdn["in_proj_qkvz"] == h * (2 * 8 * 128 + 2 * 16 * 128) and gdn["in_proj_ba"] == h * 2 * 16
    assert (gdn["conv1d"], gdn["A_log"], gdn["dt_bias"], gdn["gdn_norm"]) == ((2 * 2048 + 4096) * 4, 16, 16, 128)
    attention = layer_tensors(shape=QWEN3_NEXT, tp=2, moe=True)
    assert attention["linear_qkv"] == h * (2 * 8 + 2 * 1) * 256 and attention["q_layernorm"] == 256


def test_flops_per_mixer():
    """A Gated DeltaNet's core is linear in s; chunked attention's capped at the chunk in the model FLOPs."""
    _, short = layer_forward_flops(shape=QWEN3_NEXT, tokens=4096, seq_length=4096, mixer=LINEAR)
    _, long = layer_forward_flops(shape=QWEN3_NEXT, tokens=8192, seq_length=8192, mixer=LINEAR)
    assert long == 2 * short
    per_token_head = 64 * (2.5 * 128 + 1.5 * 128) + 3 * 128 * 128  # chunk 64, dk = dv = 128
    assert short == 4096 * 2 * (32 * per_token_head + (2 * 2048 + 4096) * 4)
    s = 32768
    full = training_flops(shape=SCOUT, tokens=s, seq_length=s, recompute="none")
    _, core = layer_forward_flops(shape=SCOUT, tokens=s, seq_length=s)
    # 36 of 48 layers chunked: each scores 8192 of the 32768 keys, 3 passes
    assert full == pytest.approx(training_flops(shape=_unchunked(SCOUT), tokens=s, seq_length=s,
                                                recompute="none") - 3 * 36 * core * (1 - 8192 / s))


def _unchunked(shape):
    import dataclasses

    return dataclasses.replace(shape, chunked_attention_layers=())


def test_gated_deltanet_heads_vs_tp():
    """tp = 4 divides the attention heads (4) but not the 2 Gated DeltaNet key heads: refused by name."""
    config = _tiny_configs()["qwen3_next"].to_dict()
    shape = shape_from_fields(config, name="n", gated_mlp=True, kv_heads_replicable=True)
    facts = ModelFacts.from_shape(shape, vocab_multiple=128)
    problems = layout_problems(layout=Layout(tp=4), model=facts)
    assert any("linear_num_key_heads=2" in p.message for p in problems)
    assert all(4 not in p.valid for p in problems if p.rule == "heads_vs_tp")


def test_the_released_qwen3_next_splits_its_two_kv_heads_and_plans_on_local_layers():
    """The gated attention splits k / v with no replication (tp <= 2 on the release's 2 KV heads), and both families
    run on megatron's local layers: `dsmt check` refuses fused attention by name, as the build would."""
    from toolkit.parallel.rules import RunFacts, valid_tp_sizes

    facts = ModelFacts.from_shape(BUILTIN_SHAPES["qwen3-next-80b-a3b"], vocab_multiple=128)
    assert valid_tp_sizes(model=facts, limit=16) == [1, 2]
    for name in ("qwen3-next-80b-a3b", "llama4-scout-17b-16e"):
        facts = ModelFacts.from_shape(BUILTIN_SHAPES[name], vocab_multiple=128)
        run = RunFacts(world_size=8, gpus_per_node=8, seq_length=4096, global_batch_size=8, micro_batch_size=1,
                       zero_stage=1, device="cuda", attention="fused")
        (problem,) = [p for p in layout_problems(layout=Layout(dp=8), model=facts, run=run)
                      if p.rule == "local_layers_only"]
        assert "training.attention: local" in problem.fix
        run = dataclasses.replace(run, attention="local")
        assert "local_layers_only" not in {p.rule for p in layout_problems(layout=Layout(dp=8), model=facts, run=run)}


def test_plan_runs_on_the_builtin_shapes():
    """Memory and time for each built-in at pp 4 (stages of different layer kinds: Maverick's, Qwen3-Next's
    pattern of 3 + 1 layers in chunks of 12)."""
    h100 = get_gpu("h100-80gb")
    layout = PlanLayout(tp=2, pp=4, dp=4, ep=4, zero_stage=1, sp=True)
    for shape in (QWEN3_NEXT, SCOUT, MAVERICK):
        assert estimate_memory(shape=shape, layout=layout, training=TrainingShape(4096, 64), gpu=h100).total_bytes > 0
        time = estimate_step_time(shape=shape, layout=layout, training=TrainingShape(4096, 64),
                                  cluster=Cluster(nodes=4, gpus_per_node=8, gpu=h100))
        assert time.step_time_s > 0 and 0 < time.mfu < 1
    assert representative_stages(shape=QWEN3_NEXT, layout=layout) == [0, 3]


def test_qwen3_next_published_totals():
    """The model card: 80 B in total, 79 B without the embeddings, 3 B activated (A3B: 3.25 B without the embedding
    and output layer, 3.87 B with both)."""
    embeddings = 2 * 151936 * 2048
    assert QWEN3_NEXT.num_params() / 1e9 == pytest.approx(79.67, abs=0.01)
    assert (QWEN3_NEXT.num_params() - embeddings) / 1e9 == pytest.approx(79.05, abs=0.01)
    assert (QWEN3_NEXT.active_params() - embeddings) / 1e9 == pytest.approx(3.25, abs=0.01)


@pytest.mark.parametrize("shape, total_b", [(SCOUT, 107.77), (MAVERICK, 400.71)])
def test_llama4_published_totals(shape, total_b):
    """17 B active (embedding and output layer counted); the model cards' 109 B / 400 B totals count the vision
    encoder and projector too (~0.89 B: transformers' Llama4VisionModel at hidden 1408, 34 layers, and the
    projector [5120, 4096]), which dsmt carries but does not train: 107.77 + 0.89 = 108.7 B for Scout."""
    assert shape.active_params() / 1e9 == pytest.approx(17.17, abs=0.02)
    assert shape.num_params() / 1e9 == pytest.approx(total_b, abs=0.01)
