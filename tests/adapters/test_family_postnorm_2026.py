"""OLMo-3 and EXAONE 4.0 (post-norm dense) alone, one process: config reading (windows, per-kind RoPE, NoPE), each
refusal by name, the weight table and layer spec they take from OLMo-2, and megatron's logits against transformers'
at TP 1 x PP 1. Logits at TP x PP are for test_parity_multiproc.py, round trips for test_convert.py."""

import math

import pytest
import torch

from tests.adapters.one_process import hf_model, megatron_model, one_process, rows
from toolkit.adapters.family import AdapterError, get_family
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.transforms import Kind
from toolkit.models.tiny import tiny_config

S, F = "sliding_attention", "full_attention"
# OLMo-3 7B / 32B as released (transformers 4 form: flat rope_theta + rope_scaling, which v5 puts on full layers).
OLMO3_RELEASE_ROPE = dict(rope_parameters=None, rope_theta=500000.0, max_position_embeddings=65536, layer_types=None,
                          num_hidden_layers=8, rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32,
                                                             "beta_slow": 1, "attention_factor": 1.2079441541679836,
                                                             "original_max_position_embeddings": 8192})


def fields_of(model_type: str, **overrides) -> dict:
    return model_settings(tiny_config(model_type, **overrides)).transformer_fields


def scales_of(quirks) -> list[float]:
    """The per-layer softmax scales, 0.0 where megatron keeps its own 1 / sqrt(head_dim) (None)."""
    return [0.0 if scale is None else scale for scale in quirks["softmax_scales"]]


def test_olmo3_windows_its_sliding_layers_and_keeps_olmo2s_layer():
    settings = model_settings(tiny_config("olmo3"))  # first: it registers every family
    fields = settings.transformer_fields
    assert fields["window_size"] == (7, 0) and fields["window_attn_skip_freq"] == [1, 0, 0, 1]
    assert "no_rope_freq" not in fields and fields.get("softmax_scale") is None  # scales are per layer
    assert settings.family.weights is get_family("olmo2").weights and settings.family.architecture.qk_norm_spans_heads
    assert not settings.tied_embeddings


def test_olmo3_takes_each_layer_kinds_rope_from_transformers():
    quirks = model_settings(tiny_config("olmo3")).quirks
    ropes = quirks["layer_ropes"]
    exponents = torch.arange(0, 8, 2, dtype=torch.float32) / 8
    torch.testing.assert_close(torch.tensor(ropes.inv_freq[S]), 1.0 / 1000.0**exponents, rtol=0, atol=0)
    # YaRN, base 1e4, factor 4, original length 32: the correction range keeps dim 0 and interpolates the rest
    yarn = (1.0 / 10000.0**exponents) / torch.tensor([1.0, 4.0, 4.0, 4.0])
    torch.testing.assert_close(torch.tensor(ropes.inv_freq[F]), yarn, rtol=1e-7, atol=0)
    assert ropes.attention_factor == {S: 1.0, F: 1.2}
    full_scale = 1.2**2 / math.sqrt(8)  # cos and sin times 1.2 on a whole head: scores times 1.44
    assert scales_of(quirks) == pytest.approx([0.0, full_scale, full_scale, 0.0], rel=1e-12)


def test_olmo3_release_rope_puts_yarn_and_its_factor_on_full_layers_only():
    quirks = model_settings(tiny_config("olmo3", **OLMO3_RELEASE_ROPE)).quirks
    ropes = quirks["layer_ropes"]
    assert ropes.sliding_layers == (True, True, True, False) * 2  # transformers' default: 3 sliding, 1 full
    default = 1.0 / 500000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(torch.tensor(ropes.inv_freq[S]), default, rtol=0, atol=0)
    assert ropes.inv_freq[F] != ropes.inv_freq[S] and ropes.attention_factor[S] == 1.0
    scale = 1.2079441541679836**2 / math.sqrt(8)
    assert scales_of(quirks) == pytest.approx([0.0, 0.0, 0.0, scale] * 2, rel=1e-12)


def test_exaone4_windows_local_layers_and_drops_rope_on_global_ones():
    fields = fields_of("exaone4")
    assert fields["window_size"] == (7, 0) and fields["window_attn_skip_freq"] == [1, 0, 0, 1]
    assert fields["no_rope_freq"] == [0, 1, 1, 0] and fields["kv_channels"] == 16 and fields["qk_layernorm"]
    # no window (EXAONE-4.0-1.2B): every layer global, every layer with RoPE (HF: `sliding_window is None or ...`)
    plain = fields_of("exaone4", sliding_window=None, layer_types=[F] * 4)
    assert "window_size" not in plain and "no_rope_freq" not in plain
    # a window but no sliding layer: HF still skips RoPE on every (global) layer
    assert fields_of("exaone4", layer_types=[F] * 4)["no_rope_freq"] == [1, 1, 1, 1]
    # transformers' own pattern (sliding_window_pattern 4, layer_types unset): 3 local, then 1 global
    assert fields_of("exaone4", layer_types=None, sliding_window_pattern=4)["no_rope_freq"] == [0, 0, 0, 1]


def test_exaone4_weights_are_olmo2s_with_per_head_qk_norms_and_both_embedding_kinds():
    def rows(**overrides):
        return {row.megatron: row for row in model_settings(tiny_config("exaone4", **overrides)).weight_table()}

    tied, untied = rows(), rows(tie_word_embeddings=False)
    for norm in ("q", "k"):
        row = tied[f"decoder.layers.*.self_attention.{norm}_layernorm.weight"]
        assert row.kind == Kind.REPLICATED and row.hf == (f"model.layers.*.self_attn.{norm}_norm.weight",)
    assert tied["decoder.layers.*.mlp_bda.norm.weight"].hf == ("model.layers.*.post_feedforward_layernorm.weight",)
    assert "decoder.final_layernorm.weight" in tied and not any("layer_norm_weight" in name for name in tied)
    assert "output_layer.weight" not in tied and untied["output_layer.weight"].hf == ("lm_head.weight",)


def test_exaone4_layer_spec_keeps_per_head_norms_without_pre_norms():
    from megatron.core.transformer.identity_op import IdentityOp

    from toolkit.adapters.families.exaone4 import edit_exaone4_layer_spec
    from toolkit.adapters.layer_specs import local_layer_spec
    from toolkit.adapters.norms import TorchNorm
    from toolkit.adapters.post_norms import NormThenAdd

    spec = edit_exaone4_layer_spec(local_layer_spec(qk_norm=True), config=None, settings=None, transformer_engine=False)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    assert attention.q_layernorm is TorchNorm and attention.k_layernorm is TorchNorm
    assert layer.input_layernorm is IdentityOp and layer.pre_mlp_layernorm is IdentityOp
    assert layer.self_attn_bda.module is NormThenAdd and layer.mlp_bda.module is NormThenAdd


def test_olmo3_needs_whole_kv_heads_per_tp_rank_and_exaone4_does_not():
    from toolkit.adapters.model_shape import model_facts
    from toolkit.parallel.layout import Layout
    from toolkit.parallel.rules import layout_problems

    olmo3, exaone4 = (model_facts(tiny_config(t, num_key_value_heads=2), vocab_pad_multiple=128)
                      for t in ("olmo3", "exaone4"))
    layout = Layout(tp=4, pp=2, dp=1)
    assert [p.rule for p in layout_problems(layout=layout, model=olmo3)] == ["kv_heads_vs_tp"]
    assert not layout_problems(layout=layout, model=exaone4)  # per-head norms: KV heads replicate as Llama's


@pytest.mark.parametrize("model_type,fields,named", [
    ("olmo3", dict(attention_bias=True), "attention_bias=True"),
    ("olmo3", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ("olmo3", dict(sliding_window=None), "sliding_window=None"),
    ("olmo3", dict(layer_types=[S, "chunked_attention", F, F]), "layer_types ['chunked_attention']"),
    ("olmo3", dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4},
                                    F: {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}),
     "rope_parameters.full_attention.rope_type='dynamic'"),
    ("olmo3", dict(rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                                    F: {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters.sliding_attention.partial_rotary_factor=0.5"),
    ("exaone4", dict(sliding_window=None), "sliding_window=None with 'sliding_attention' layers"),
    ("exaone4", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ("exaone4", dict(layer_types=[S, "chunked_attention", F, F]), "layer_types ['chunked_attention']"),
    ("exaone4", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                      "original_max_position_embeddings": 32}), "rope_type 'yarn'"),
])
def test_unreproduced_fields_are_refused_by_name(model_type, fields, named):
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace(".", r"\.").replace("[", r"\[")):
        model_settings(tiny_config(model_type, **fields))


def test_megatron_logits_equal_transformers_in_one_process(tmp_path):
    """TP 1 x PP 1: the full layers' YaRN scale (OLMo-3) and NoPE (EXAONE) as built, and logits within 1e-5."""
    from toolkit.models.tiny import make_tiny_checkpoint

    tokens = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))  # longer than the window
    with one_process():
        for model_type in ("olmo3", "exaone4"):
            path = make_tiny_checkpoint(tmp_path / model_type, model_type=model_type, seed=3)
            model = megatron_model(path)
            attentions = [layer.self_attention for layer in model.decoder.layers]
            if model_type == "olmo3":
                scales = [attention.core_attention.softmax_scale for attention in attentions]
                assert scales == pytest.approx([8**-0.5, 1.44 * 8**-0.5, 1.44 * 8**-0.5, 8**-0.5], rel=1e-12)
            else:
                assert model.config.no_rope_freq == [0, 1, 1, 0]
            with torch.no_grad():
                logits = model(tokens, rows(tokens), None)[..., :250]
                reference = hf_model(path)(tokens).logits
            assert (logits - reference).abs().max().item() < 1e-5, model_type


def test_olmo3_layer_without_its_scale_is_refused_by_name():
    """Transformer Engine < 1.10 drops megatron's softmax_scale: a layer whose RoPE kind scales the scores but whose
    core attention does not hold that scale stops the build."""
    from toolkit.adapters.families.olmo3 import check_layer_scales

    def layer(number: int, scale):
        attention = torch.nn.Module()
        attention.layer_number, attention.core_attention = number, torch.nn.Module()
        attention.core_attention.softmax_scale = scale
        return attention

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    model.layers[0].self_attention, model.layers[1].self_attention = layer(1, None), layer(2, 0.3)
    check_layer_scales(model, scales=(None, 0.3))  # held
    model.layers[1].self_attention.core_attention.softmax_scale = None
    with pytest.raises(AdapterError, match=r"layers\.1\.self_attention\.core_attention .* by None, not the 0\.3"):
        check_layer_scales(model, scales=(None, 0.3))
