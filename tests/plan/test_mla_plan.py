"""The planner on DeepSeek-V2 / V3 (multi-latent attention, shared experts, dense first layers) and Qwen2-MoE (a gated
shared expert, dense layers by mlp_only_layers): parameter counts exact against transformers' models, MLA's TP
sharding, shared experts outside EP, per-stage layer mixes, activations and FLOPs computed by hand from the formulas
of toolkit/plan/layers.py, activations.py and timing.py (written out in each test), and `dsmt plan` end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest

from toolkit.cli import main
from toolkit.models.moe_shapes import CONFIG_DEFAULTS, MlaShape
from toolkit.adapters.model_shape import load_model_shape, shape_from_config
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape
from toolkit.plan.activations import activation_bytes_per_layer
from toolkit.plan.hardware import get_gpu
from toolkit.plan.layers import layer_tensors, representative_stages, stage_layer_counts
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import estimate_memory, stage_params_per_gpu
from toolkit.plan.timing import estimate_step_time, layer_forward_flops, training_flops

H100 = get_gpu("h100-80gb")
V3 = BUILTIN_SHAPES["deepseek-v3"]
V2_LITE = BUILTIN_SHAPES["deepseek-v2-lite"]
# h 64, 4 layers (layer 0 dense, width 96), 4 heads, MLA q latent 24 / kv latent 16 / nope 8 / rope 4 / v 12, vocab
# 256, 8 SwiGLU experts of width 32, top-2, one shared expert of width 32.
SMALL_DS = ModelShape("small-ds", 64, 4, 4, 4, 96, 256, False, True, 128, head_dim=12, num_experts=8, moe_topk=2,
                      moe_ffn_hidden_size=32, mla=MlaShape(24, 16, 8, 4, 12), shared_expert_ffn_hidden_size=32,
                      dense_layers=(0,))
# DeepSeek-V3's config.json (the fields the shape reads).
V3_CONFIG = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
             "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
             "num_key_value_heads": 128, "n_shared_experts": 1,
             "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
             "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
             "hidden_act": "silu", "num_nextn_predict_layers": 1}
PLAN_V3 = ["plan", "deepseek-v3", "--nodes", "32", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--seq-len", "4096",
           "--global-batch", "1024"]


def _tiny_configs():
    import transformers

    small = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4)
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=4,
               num_experts_per_tok=2)
    return {
        "deepseek_v2_lite": transformers.DeepseekV2Config(**small, **mla, q_lora_rank=None, n_shared_experts=2,
                                                          first_k_dense_replace=1),
        "deepseek_v3": transformers.DeepseekV3Config(**small, **mla, num_key_value_heads=4, q_lora_rank=24,
                                                     n_shared_experts=1, n_group=2, topk_group=1,
                                                     first_k_dense_replace=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(**small, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                 shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    }


@pytest.mark.parametrize("name", ["deepseek_v2_lite", "deepseek_v3", "qwen2_moe"])
def test_param_count_equals_the_hf_model(name, tmp_path):
    """config.json -> shape -> count equals transformers' model, layer by layer (MLA, dense layers, shared experts,
    Qwen2-MoE's gate and q / k / v biases) and as a whole."""
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()[name]
    config.save_pretrained(tmp_path)  # transformers writes head_dim = qk_rope_head_dim for MLA: ignored
    shape = load_model_shape(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    for i, layer in enumerate(model.model.layers):
        assert sum(p.numel() for p in layer.self_attn.parameters()) == shape.attention_params()
        assert sum(p.numel() for p in layer.mlp.parameters()) == shape.mlp_params(moe=shape.is_moe_layer(i))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    # the planner's per-rank tensors at tp = pp = ep = 1 are the whole model (vocabulary 256: no padding rows)
    assert stage_params_per_gpu(shape=shape, layout=PlanLayout(tp=1, pp=1, dp=4), stage=0) == shape.num_params()


def test_config_defaults_are_transformers_defaults():
    import transformers

    classes = {"deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config,
               "glm4_moe": transformers.Glm4MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig}
    for model_type, defaults in CONFIG_DEFAULTS.items():
        config = classes[model_type]()
        assert {k: getattr(config, k) or None for k in defaults} == {k: v or None for k, v in defaults.items()}


def test_deepseek_v3_published_shape_by_hand():
    """DeepSeek-V3's config numbers: 671.03 B parameters in the model transformers loads (its MTP layer, 'layer 61',
    is not part of it: the 671 B DeepSeek publishes is the main model; the 685 B checkpoint adds ~14 B of MTP)."""
    h, heads, vocab = 7168, 128, 129280
    attention = (1536 * h + 1536 + heads * 192 * 1536      # q down, q latent norm, q up (nope 128 + rope 64)
                 + (512 + 64) * h + 512                       # kv down (latent + shared rope key), kv latent norm
                 + heads * (128 + 128) * 512 + heads * 128 * h)  # kv up (nope + v), o proj
    dense_mlp, expert = 3 * h * 18432, 3 * h * 2048
    moe_mlp = 256 * expert + 256 * h + expert              # routed experts, router, one shared expert
    total = 61 * (attention + 2 * h) + 3 * dense_mlp + 58 * moe_mlp + 2 * vocab * h + h
    assert V3.num_params() == total == 671_026_404_352
    active = total - 58 * (256 - 8) * expert              # each token: its top-8 of the routed experts
    assert V3.active_params() == active == 37_552_282_624  # "37B activated"
    assert shape_from_config(V3_CONFIG, name="deepseek-v3") == V3


@pytest.mark.parametrize("name, total_b, active_b", [
    ("deepseek-v2-lite", 15.7, 2.66), ("deepseek-v2", 235.7, 21.4), ("qwen1.5-moe-a2.7b", 14.3, 2.69),
    ("qwen2-57b-a14b", 57.4, 14.2)])
def test_published_totals(name, total_b, active_b):
    """The releases' published totals (15.7 B, 236 B, 14.3 B, 57 B); active counts include both embeddings."""
    shape = BUILTIN_SHAPES[name]
    assert shape.num_params() / 1e9 == pytest.approx(total_b, abs=0.05)
    assert shape.active_params() / 1e9 == pytest.approx(active_b, abs=0.05)


def test_mla_tensors_per_tp_rank():
    """tp = 8 on DeepSeek-V3: the per-head projections split by heads (16 per rank); the down projections whole on
    every rank, with Transformer Engine (duplicated TELinear) and dsmt's local layers (megatron's plain Linear)."""
    te = layer_tensors(shape=V3, tp=8, moe=True)
    assert {k: te[k] for k in ("linear_q_down_proj", "linear_kv_down_proj", "q_layernorm", "kv_layernorm")} == {
        "linear_q_down_proj": 1536 * 7168, "linear_kv_down_proj": 576 * 7168, "q_layernorm": 1536,
        "kv_layernorm": 512}
    assert te["linear_q_up_proj"] == 16 * 192 * 1536 and te["linear_kv_up_proj"] == 16 * 256 * 512
    assert te["linear_proj"] == 16 * 128 * 7168
    local = layer_tensors(shape=V3, tp=8, moe=True, layer_spec="local")
    assert (local["linear_q_down_proj"], local["linear_kv_down_proj"]) == (1536 * 7168, 576 * 7168)
    # the shared expert like a dense MLP at width 2048 / 8, the router replicated
    assert (te["shared_fc1"], te["shared_fc2"], te["router"]) == (7168 * 256 * 2, 256 * 7168, 256 * 7168)
    assert "linear_qkv" not in te
    lite = layer_tensors(shape=V2_LITE, tp=2, moe=False)
    assert lite["linear_q_proj"] == 8 * 192 * 2048 and "linear_q_down_proj" not in lite
    assert lite["linear_fc1"] == 2048 * 10944 // 2 * 2  # dense first layer at intermediate_size


def test_qwen2_moe_gate_and_biases_per_tp_rank():
    qwen = BUILTIN_SHAPES["qwen2-57b-a14b"]  # 28 heads of 128, 4 KV heads, shared width 20480
    t = layer_tensors(shape=qwen, tp=4, moe=True)
    assert t["linear_qkv_bias"] == (7 + 2 * 1) * 128 and t["shared_gate"] == 3584
    assert t["shared_fc1"] == 3584 * 5120 * 2


def test_shared_experts_are_dense_parameters_not_split_by_ep():
    """tp = 8 on DeepSeek-V3: raising ep removes routed experts only; at bf16 ZeRO-1 the shared experts' states
    are partitioned with the dense parameters over dp x cp, the routed experts' over expert_dp."""
    params = {ep: stage_params_per_gpu(shape=V3, layout=PlanLayout(tp=8, pp=1, dp=32, ep=ep, sp=True), stage=0)
              for ep in (1, 8)}
    assert params[1] - params[8] == 58 * (256 - 32) * 3 * 7168 * 2048 // 8
    # SMALL_DS at tp = 1: per layer attention 8320 matrices + 40 latent norms + 128 norms; layer 0 dense MLP 18432;
    # layers 1-3 router 512 + shared 6144; embedding and output layer 256·64 each, final norm 64
    dense = 4 * (8320 + 40 + 128) + 18432 + 3 * (512 + 6144) + 2 * 256 * 64 + 64
    experts = 3 * (8 // 4) * (64 * 32 * 2 + 32 * 64)
    assert (dense, experts) == (105184, 36864)
    memory = estimate_memory(shape=SMALL_DS, layout=PlanLayout(tp=1, pp=1, dp=8, ep=4, zero_stage=1),
                             training=TrainingShape(128, 64), gpu=H100)
    assert memory.expert_params_per_gpu == experts and memory.params_per_gpu == dense + experts
    assert memory.optimizer == 12 * (dense // 8 + experts // 2)


def test_dense_first_layers_per_stage():
    """DeepSeek-V2-Lite (27 layers, layer 0 dense) at pp = 3: stage 0 holds the dense layer, stages 1 and 2 nine MoE
    layers each; all three are computed, and the stages add up to the model."""
    layout = PlanLayout(tp=1, pp=3, dp=8)
    assert [stage_layer_counts(shape=V2_LITE, layout=layout, stage=s) for s in range(3)] == [(1, 8), (0, 9), (0, 9)]
    interleaved = dataclasses.replace(layout, vpp=3)  # stage 0 holds chunks 0, 3, 6: layers 0-2, 9-11, 18-20
    assert stage_layer_counts(shape=V2_LITE, layout=interleaved, stage=0) == (1, 8)
    assert representative_stages(shape=V2_LITE, layout=layout) == [0, 1, 2]
    assert representative_stages(shape=BUILTIN_SHAPES["mixtral-8x7b"], layout=PlanLayout(tp=1, pp=4, dp=2)) == [0, 3]
    assert sum(stage_params_per_gpu(shape=V2_LITE, layout=layout, stage=s) for s in range(3)) == V2_LITE.num_params()
    memory = estimate_memory(shape=V2_LITE, layout=layout, training=TrainingShape(4096, 64), gpu=H100)
    assert [m.stage for m in memory.stages] == [0, 1, 2]
    expert = 3 * 2048 * 1408
    assert [m.expert_params_per_gpu for m in memory.stages] == [8 * 64 * expert, 9 * 64 * expert, 9 * 64 * expert]


def test_mla_activations_per_layer():
    """te layers, fused attention, tp = 1, s = 128, b = 1, ab = 2, per token. Both kinds: two norms 2·ab·h, two
    linear inputs 2·ab·h, the q and kv latents (norm input + up-projection input) 2·ab·(24 + 16) = 160; contiguous
    query and key 2·ab·4·12, value ab·4·12, the projection input ab·4·12, LSE 4·4. The dense layer: SwiGLU at
    width 96, 3·ab·96; the MoE layer: router probabilities 4·8, two routed copies of (ab·h + 3·ab·32) and the
    shared expert 3·ab·32. Per micro-batch: RoPE cos / sin at the 4 rope dims, 4·s·4·ab."""
    common_replicated, common_split = 4 * 2 * 64 + 160, 2 * 4 * 36 + 2 * 4 * 12 + 16
    rope = 4 * 128 * 4 * 2
    for moe, replicated, split in ((False, 0, 3 * 2 * 96), (True, 32, 2 * (128 + 192) + 192)):
        got = activation_bytes_per_layer(shape=SMALL_DS, seq_length=128, micro_batch_size=1, tp=1,
                                         sequence_parallel=False, recompute="none", moe=moe)
        assert got == 128 * (common_replicated + replicated) + 128 * (common_split + split) + rope
    assert got == 251904


def test_mla_and_moe_flops_per_token():
    """DeepSeek-V3, one token attending to 4096 keys: the attention matrices (q down / up, kv down / up, o) on every
    token; an MoE layer's router, top-8 experts and shared expert, a dense layer's whole MLP; the core QK^T over
    nope + rope = 192 dims and AV over v = 128 dims."""
    h = 7168
    attention = 1536 * h + 128 * 192 * 1536 + 576 * h + 128 * 256 * 512 + 128 * 128 * h
    moe_mlp = 256 * h + 8 * 3 * h * 2048 + 3 * h * 2048
    dense_mlp = 3 * h * 18432
    matmul, core = layer_forward_flops(shape=V3, tokens=1, seq_length=4096, moe=True)
    assert (matmul, core) == (2.0 * (attention + moe_mlp), 2.0 * 4096 * 128 * (192 + 128))
    assert layer_forward_flops(shape=V3, tokens=1, seq_length=4096, moe=False)[0] == 2.0 * (attention + dense_mlp)
    expected = 3 * (58 * (2 * (attention + moe_mlp) + core) + 3 * (2 * (attention + dense_mlp) + core)
                    + 2 * 129280 * h)
    assert training_flops(shape=V3, tokens=1, seq_length=4096, recompute="none") == expected
    # Narayanan's 6 x parameters rule on the active parameters (without the input embedding) plus attention
    assert expected == pytest.approx(6 * (V3.active_params() - 129280 * h) + 3 * 61 * core, rel=1e-3)


def test_slowest_stage_with_dense_layers():
    """DeepSeek-V2-Lite at pp = 3, ep = 1: the last stage (nine MoE layers and the logits) is the slowest; its
    compute is the step's (per micro-batch, 3 passes, over the efficiency-scaled peak)."""
    layout = PlanLayout(tp=1, pp=3, dp=8, zero_stage=1)
    cluster = Cluster(nodes=3, gpus_per_node=8, gpu=H100)
    time = estimate_step_time(shape=V2_LITE, layout=layout, training=TrainingShape(4096, 64), cluster=cluster)
    matmul, core = layer_forward_flops(shape=V2_LITE, tokens=4096, seq_length=4096, moe=True)
    last = 9 * 3 * (matmul + core) + 6 * 4096 * 102400 * 2048
    assert time.compute_s == pytest.approx(8 * last / (989e12 * H100.matmul_efficiency), rel=1e-12)


def test_plan_deepseek_v3_on_256_h100s(capsys):
    assert main(PLAN_V3 + ["--json", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == 671_026_404_352 and data["num_active_params"] == 37_552_282_624
    assert data["mla"] == {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                           "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert data["moe"]["dense_layers"] == [0, 1, 2] and data["moe"]["shared_expert_ffn_hidden_size"] == 2048
    assert data["layouts"] and all(x["pp"] == 1 for x in data["layouts"])  # 61 layers: pp 1 or 61
    assert main(PLAN_V3 + ["--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "multi-latent attention (q latent 1536, kv latent 512" in text and "layers 0-2 are dense" in text
    assert "always-active shared-expert MLP of width 2048" in text


def test_plan_reads_an_hf_config_dir_and_counts_lora_on_mla(tmp_path, capsys):
    config = dict(V3_CONFIG, num_hidden_layers=4, n_routed_experts=16, hidden_size=1024, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["plan", str(tmp_path), "--nodes", "1", "--seq-len", "1024", "--global-batch", "16", "--top", "1"]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe"]["dense_layers"] == [0, 1, 2]
    # dsmt's default targets on DeepSeek-V3: MLA's projections and the routed experts (PEFT reads the shared
    # experts' and dense MLP's names as the experts: withheld; tests/plan/test_plan_lora_moe.py)
    assert main(args + ["--lora-rank", "8"]) == 0
    assert "LoRA rank 8 on q_a, q_b, kv_a, kv_b, o, expert_gate_up, expert_down:" in capsys.readouterr().out
