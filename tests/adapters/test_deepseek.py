"""DeepSeek-V2 / V3 and Qwen2-MoE: their tables against saved checkpoints, the dense / MoE layer pattern, the
routing settings read from HF configs, HF's group choice where megatron-core's differs, and what is refused."""

import pytest
import torch
from safetensors import safe_open

from tests.adapters.conftest import MOONLIGHT
from tests.adapters.one_process import max_logit_gap, megatron_logits, rows
from toolkit.adapters.family import AdapterError, get_family
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.load import check_hf_coverage
from toolkit.adapters.routing import GroupLimitedTopk
from toolkit.adapters.transforms import Kind
from toolkit.models.tiny import make_tiny_checkpoint, tiny_config

NEW_FAMILIES = ["deepseek_v2", "deepseek_v3", "qwen2_moe"]
# Moonlight-16B-A3B's shape on the tiny DeepSeek-V3 (Kimi-VL's text model too): a plain q projection (q_lora_rank
# null), rms_norm_eps 1e-5 (HF's latent norms keep 1e-6), one expert group, 2 shared experts, factor 2.446, rope_theta
# 50000 without scaling, no MTP layer.


@pytest.mark.parametrize("model_type,overrides", [
    ("deepseek_v2", {}), ("deepseek_v2", dict(q_lora_rank=24)), ("deepseek_v3", {}), ("deepseek_v3", dict(q_lora_rank=None)),
    ("qwen2_moe", {}),
])
def test_table_covers_every_tensor_of_a_saved_checkpoint(model_type, overrides, tmp_path):
    path = make_tiny_checkpoint(tmp_path / model_type, model_type=model_type, num_hidden_layers=3, **overrides)
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    settings = model_settings(tiny_config(model_type, num_hidden_layers=3, **overrides))
    items = settings.load_items()
    assert check_hf_coverage(items=items, hf_names=names, ignored=settings.ignored_hf()) == []
    assert sorted({hf for item in items.values() for hf in item.hf}) == sorted(names)  # nothing ignored, all used


def test_dense_and_moe_layers_follow_the_hf_config():
    assert model_settings(tiny_config("deepseek_v3")).moe_layers == {1, 2, 3}  # first_k_dense_replace = 1
    assert model_settings(tiny_config("deepseek_v2", first_k_dense_replace=3)).moe_layers == {3}
    assert model_settings(tiny_config("qwen2_moe")).moe_layers == {0, 2, 3}  # mlp_only_layers = [1]
    assert model_settings(tiny_config("qwen2_moe", mlp_only_layers=[], decoder_sparse_step=2)).moe_layers == {1, 3}
    items = model_settings(tiny_config("deepseek_v3")).load_items()
    assert "decoder.layers.0.mlp.linear_fc1.weight" in items and "decoder.layers.0.mlp.router.weight" not in items
    assert "decoder.layers.1.mlp.router.expert_bias" in items and "decoder.layers.1.mlp.linear_fc1.weight" not in items
    assert items["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"].kind is Kind.GATE_UP
    assert items["decoder.layers.2.self_attention.linear_kv_down_proj.weight"].kind is Kind.REPLICATED


def test_mla_and_routing_settings():
    v2 = model_settings(tiny_config("deepseek_v2")).transformer_fields
    assert (v2["q_lora_rank"], v2["kv_lora_rank"], v2["qk_head_dim"], v2["qk_pos_emb_head_dim"], v2["v_head_dim"]) \
        == (None, 32, 16, 8, 16)
    assert (v2["rope_type"], v2["rotary_scaling_factor"], v2["mscale"], v2["mscale_all_dim"]) == ("yarn", 4.0, 0.707, 0.707)
    assert v2["moe_router_pre_softmax"] is True and v2["moe_router_topk_scaling_factor"] is None
    assert v2["moe_shared_expert_intermediate_size"] == 2 * 32 and v2["ffn_hidden_size"] == 96
    v3 = model_settings(tiny_config("deepseek_v3")).transformer_fields
    assert (v3["moe_router_score_function"], v3["moe_router_enable_expert_bias"], v3["moe_router_bias_update_rate"]) \
        == ("sigmoid", True, 0.0)
    assert (v3["moe_router_num_groups"], v3["moe_router_group_topk"], v3["moe_router_topk_scaling_factor"]) == (2, 1, 2.5)
    assert v3["rope_type"] == "rope" and v3["moe_router_load_balancing_type"] == "none"
    qwen = model_settings(tiny_config("qwen2_moe", output_router_logits=True, router_aux_loss_coef=0.02)).transformer_fields
    assert qwen["moe_shared_expert_gate"] is True and qwen["moe_shared_expert_intermediate_size"] == 64
    assert qwen["moe_aux_loss_coeff"] == pytest.approx(0.02 * 2 / 3)  # three MoE layers of four


def test_hf_group_choice_where_megatron_ranks_groups_otherwise():
    """DeepSeek-V2 ranks groups by their best score; megatron by the sum of the top k / topk_group. With 8 experts
    in 4 groups, 2 groups of top-4: the HF choice (GroupLimitedTopk) differs from megatron's own for some tokens,
    and equals a direct transcription of transformers' router."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    torch.manual_seed(0)
    logits = torch.randn(64, 8)
    scores = logits.softmax(dim=-1)
    choice = GroupLimitedTopk(num_groups=4, group_topk=2, group_score_topk=1, masked_score=0.0)
    hf_probs, hf_map = topk_routing_with_score_function(logits, 4, use_pre_softmax=True, router_replay=choice)
    # transformers' DeepseekV2TopkRouter.forward, group_limited_greedy, written out
    group_scores = scores.view(-1, 4, 2).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, 4, 2).reshape(-1, 8)
    weights, indices = torch.topk(scores.masked_fill(~score_mask.bool(), 0.0), k=4, dim=-1, sorted=False)
    expected = torch.zeros_like(scores).scatter(1, indices, weights)
    assert torch.equal(hf_map, expected > 0) and torch.equal(hf_probs, expected)
    _, native_map = topk_routing_with_score_function(logits, 4, use_pre_softmax=True, num_groups=4, group_topk=2)
    assert not torch.equal(native_map, hf_map)  # megatron's own rule would route some tokens elsewhere


def test_group_choice_is_set_only_where_megatrons_rule_differs():
    assert "group_choice" not in model_settings(tiny_config("deepseek_v3")).quirks  # k / topk_group = 2: native
    v3 = model_settings(tiny_config("deepseek_v3", n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2))
    assert v3.quirks["group_choice"].group_score_topk == 2 and v3.transformer_fields["moe_router_num_groups"] is None
    v2 = model_settings(tiny_config("deepseek_v2", topk_method="group_limited_greedy", n_group=2, topk_group=1))
    assert v2.quirks["group_choice"].group_score_topk == 1 and v2.quirks["group_choice"].masked_score == 0.0
    assert "group_choice" not in model_settings(tiny_config("deepseek_v2")).quirks  # greedy


@pytest.mark.parametrize("model_type,overrides,message", [
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=true: transformers' DeepseekV2 ignores it"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("deepseek_v2", dict(attention_bias=True), "attention_bias=true"),
    ("deepseek_v2", dict(mlp_bias=True), "mlp_bias=true"),
    ("deepseek_v2", dict(moe_layer_freq=2), "moe_layer_freq=2"),
    ("deepseek_v2", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type 'linear'"),
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=false with sigmoid routing"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=false"),
    ("deepseek_v3", dict(n_group=3), "n_group=3 does not divide n_routed_experts=4"),
    ("deepseek_v3", dict(n_shared_experts=0), "n_shared_experts=0"),
    ("deepseek_v3", dict(num_experts_per_tok=1, n_group=1, topk_group=1), "num_experts_per_tok=1 with norm_topk_prob=true"),
    ("deepseek_v2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.707,
                                          "original_max_position_embeddings": 32}), "mscale=0.707, mscale_all_dim=None"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    ("qwen2_moe", dict(mlp_only_layers=[0, 1, 2, 3]), "no MoE layer"),
    ("qwen2_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_configs_megatron_cannot_reproduce_are_refused(model_type, overrides, message):
    with pytest.raises(AdapterError, match=message.replace("[", "\\[").replace("(", "\\(").replace(")", "\\)")):
        model_settings(tiny_config(model_type, **overrides))


def test_local_mla_layer_keys_its_norms_as_transformer_engine_does(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    from toolkit import backend as backends
    from toolkit.adapters.layer_specs import layer_spec
    from toolkit.adapters.norms import TorchNorm

    spec = layer_spec(attention="local", num_experts=4, mla=True)
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm is TorchNorm and attention.kv_layernorm is TorchNorm
    # the down projections whole on every TP rank, as TE's duplicated TELinear: megatron's local default (column-
    # parallel, output gathered) gives the shared rope key the gradient of this rank's heads only
    from megatron.core.post_training.modelopt.layers import Linear
    assert attention.linear_q_down_proj is Linear and attention.linear_kv_down_proj is Linear
    assert spec.submodules.sharded_state_dict_keys_map["self_attention.kv_layernorm."] == \
        "self_attention.linear_kv_up_proj.layer_norm_"
    te = backends.Backend(name="cuda", dist_backend="nccl", use_transformer_engine=True)
    monkeypatch.setattr(backends, "current", lambda: te)
    asked = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kwargs: asked.append(kwargs) or spec)
    layer_spec(attention="fused", num_experts=4, mla=True)
    assert asked == [dict(qk_layernorm=True, num_experts=4, moe_grouped_gemm=False, multi_latent_attention=True)]


def test_moonlight_latent_norms_keep_hfs_eps_on_local_and_transformer_engine_layers():
    """megatron's MLA builds both latent norms with layernorm_epsilon (= rms_norm_eps, 1e-5 in Moonlight); HF's are
    1e-6. The DeepSeek families' spec edit gives them HF's eps (TE: unfused, the norm apart from the up projection,
    keyed under the fused names), and leaves a model whose eps is HF's alone."""
    import dataclasses

    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TELayerNormColumnParallelLinear

    from toolkit.adapters.layer_specs import layer_spec
    from toolkit.adapters.mla import HFLatentNorm, edit_mla_layer_spec
    from toolkit.adapters.norms import TorchNorm

    settings = model_settings(tiny_config("deepseek_v3", **MOONLIGHT))
    assert settings.transformer_fields["q_lora_rank"] is None and settings.transformer_fields["layernorm_epsilon"] == 1e-5
    config = type("Config", (), {"layernorm_epsilon": 1e-5, "normalization": "RMSNorm", "sequence_parallel": False,
                                 "layernorm_zero_centered_gamma": False})()
    local = settings.family.edit_layer_spec(layer_spec(attention="local", num_experts=4, mla=True), config=config,
                                            settings=settings, transformer_engine=False)
    attention = local.submodules.self_attention.submodules
    assert attention.q_layernorm is HFLatentNorm and attention.kv_layernorm is HFLatentNorm
    norm = attention.kv_layernorm(config, 32, eps=1e-5)  # what megatron's MLA passes
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert local.submodules.input_layernorm is TorchNorm  # the layer norms keep rms_norm_eps
    local = layer_spec(attention="local", num_experts=4, mla=True)  # stands in for TE's layer: only names count
    fused = dataclasses.replace(local.submodules.self_attention, submodules=dataclasses.replace(
        local.submodules.self_attention.submodules, linear_kv_up_proj=TELayerNormColumnParallelLinear))
    te_spec = dataclasses.replace(local, submodules=dataclasses.replace(local.submodules, self_attention=fused))
    te = edit_mla_layer_spec(te_spec, config=config, settings=settings, transformer_engine=True)
    te_attention = te.submodules.self_attention.submodules
    assert te_attention.linear_kv_up_proj is TEColumnParallelLinear and te_attention.kv_layernorm is HFLatentNorm
    assert te.submodules.sharded_state_dict_keys_map["self_attention.kv_layernorm."] == \
        "self_attention.linear_kv_up_proj.layer_norm_"
    config.layernorm_epsilon = 1e-6  # every DeepSeek release: megatron's own layer
    assert edit_mla_layer_spec(te_spec, config=config, settings=settings, transformer_engine=True) is te_spec


def test_moonlight_logits_equal_transformers_only_with_hfs_latent_eps(tmp_path, monkeypatch):
    """One process, fp32: a Moonlight-shaped model whose kv latent is small (kv_a_proj_with_mqa x 0.01), so the
    latent norm's eps moves the logits, matches HF; with megatron's latent eps (rms_norm_eps) it does not."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from toolkit.adapters import family as family_module
    from toolkit.adapters.families import deepseek_v3

    path = make_tiny_checkpoint(tmp_path / "moonlight", model_type="deepseek_v3", seed=21, num_hidden_layers=2,
                                **MOONLIGHT)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("kv_a_proj_with_mqa.weight")]:
        tensors[name] = tensors[name] * 0.01
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    exact = _megatron_vs_hf_max_diff(path)
    assert exact < 1e-5, exact
    without_edit = dataclasses.replace(deepseek_v3.DEEPSEEK_V3, edit_layer_spec=None)  # megatron's latent eps
    monkeypatch.setitem(family_module._REGISTRY, "deepseek_v3", without_edit)
    wrong = _megatron_vs_hf_max_diff(path)
    assert wrong > 1e-3, wrong


def _megatron_vs_hf_max_diff(path) -> float:
    """max |megatron - HF| logits of the checkpoint at `path`, one process, fp32, 2 rows of 24 tokens."""
    return max_logit_gap(path, tokens=torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0)))


def test_lora_adapts_mla_and_the_routed_experts_not_what_peft_redirects():
    """Issue 50: multi-latent attention's projections and the fused routed experts take adapters; the dense and
    shared-expert MLPs of DeepSeek do not (PEFT on transformers 5 reads gate_proj / up_proj / down_proj of a
    deepseek model as its routed experts), Qwen2-MoE's do (PEFT converts nothing there)."""
    from toolkit.adapters.hf_config import model_settings
    from toolkit.train.lora.targets import resolve_targets

    names = {model_type: [m.name for m in resolve_targets(get_family(model_type), None,
                                                          rows=model_settings(tiny_config(model_type)).rows)]
             for model_type in NEW_FAMILIES}
    experts = ["experts.gate_up_proj", "experts.down_proj"]
    assert names["deepseek_v2"] == ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + experts, names
    assert names["deepseek_v3"] == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + experts
    assert names["qwen2_moe"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                  "gate_proj", "up_proj", "down_proj"] + experts  # dense layers, shared expert


def _mtp_tensors(hidden: int, vocab: int, *, layer: int) -> dict:
    """Some of the tensors of a DeepSeek-V3 multi-token-prediction layer as published (after the decoder)."""
    torch.manual_seed(5)
    prefix = f"model.layers.{layer}"
    return {f"{prefix}.enorm.weight": torch.randn(hidden, dtype=torch.bfloat16),
            f"{prefix}.hnorm.weight": torch.randn(hidden, dtype=torch.bfloat16),
            f"{prefix}.eh_proj.weight": torch.randn(hidden, 2 * hidden, dtype=torch.bfloat16),
            f"{prefix}.shared_head.head.weight": torch.randn(vocab, hidden, dtype=torch.bfloat16),
            f"{prefix}.mlp.gate.e_score_correction_bias": torch.randn(4, dtype=torch.float32)}


@pytest.mark.parametrize("model_type,overrides", [(name, {}) for name in NEW_FAMILIES] + [
    ("deepseek_v3", MOONLIGHT), ("glm4_moe", {})])
def test_bf16_round_trip_is_bit_exact_mtp_layers_included(model_type, overrides, tmp_path, capsys):
    """HF -> dsmt megatron -> HF: every tensor back bit for bit in its own dtype (DeepSeek-V3's multi-token-prediction
    layer too), except the router weights transformers keeps in float32 inside a bf16 model
    (`_keep_in_fp32_modules_strict`): megatron's parameters share one dtype, so they come back as their bf16
    rounding, and the conversion says so."""
    from safetensors.torch import load_file, save_file

    from toolkit.cli import main as dsmt

    src = make_tiny_checkpoint(tmp_path / "hf", model_type=model_type, dtype=torch.bfloat16,
                               **{**overrides, "num_nextn_predict_layers": 1} if overrides else {})
    original = load_file(src / "model.safetensors")
    if model_type in ("deepseek_v3", "glm4_moe"):  # one MTP layer after the 4 decoder layers, as published
        original |= _mtp_tensors(64, 250, layer=4)
        save_file(original, src / "model.safetensors", metadata={"format": "pt"})
    assert dsmt(["convert", "hf-to-mcore", str(src), str(tmp_path / "mcore"), "--quiet"]) == 0
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back"), "--quiet"]) == 0
    back = {k: v for p in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(p).items()}
    assert sorted(back) == sorted(original)
    rounded = sorted(k for k, v in original.items() if k.endswith("mlp.gate.weight") and v.dtype == torch.float32)
    for name, tensor in original.items():
        expected = tensor.to(torch.bfloat16).to(tensor.dtype) if name in rounded else tensor
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], expected), name
    note = capsys.readouterr().out
    if model_type.startswith("deepseek") or model_type == "glm4_moe":
        assert rounded and "model.layers.*.mlp.gate.weight stored in a wider dtype than bfloat16" in note
    else:
        assert not rounded and "wider dtype" not in note


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_packed_records_attend_as_alone_with_mla(model_type, tmp_path):
    """MLA rotates q / k inside its attention at positions 0 .. s-1 of the row (GPTModel's position-ids RoPE does
    not reach it); RoPE scores depend on relative positions only, so with the packed block-diagonal mask a record
    later in the row (YaRN too) gives its logits as alone, within rounding."""
    from toolkit.adapters.packed import packed_attention_mask

    path = make_tiny_checkpoint(tmp_path / model_type, model_type=model_type, num_hidden_layers=2)
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randint(3, 250, (1, 20), generator=generator), torch.randint(3, 250, (1, 44), generator=generator)
    positions = torch.cat([torch.arange(20), torch.arange(44)])[None]
    packed, *alone = megatron_logits(path, batches=[(torch.cat([first, second], dim=1), positions,
                                                     packed_attention_mask(positions))]
                                     + [(ids, rows(ids), None) for ids in (first, second)])
    packed, alone = packed[..., :250], [logits[..., :250] for logits in alone]  # the padded vocabulary is -inf
    assert (packed[:, :20] - alone[0]).abs().max() < 1e-5
    assert (packed[:, 20:] - alone[1]).abs().max() < 1e-5
    assert packed[:, 20:].abs().max() > 0.1  # real logits


def test_mla_keeps_the_unfused_rope_on_gpus():
    """megatron refuses fused RoPE for MLA without YaRN and with YaRN switches to its own triton MLA kernels."""
    from toolkit.adapters.fusions import fusion_fields

    for model_type, fused in (("deepseek_v3", False), ("deepseek_v2", False), ("qwen2_moe", True)):
        fields = fusion_fields(settings=model_settings(tiny_config(model_type)), device="cuda", te_layers=True,
                               fused_rope=True)
        assert fields["apply_rope_fusion"] is fused, model_type
