"""Family tables, config translation and layout rules: everything checked before a tensor is read."""

import pytest
import torch

from toolkit.adapters.family import AdapterError, expand_table, get_family, supported_model_types
from toolkit.adapters.hf_config import model_settings, rope_settings
from toolkit.adapters.load import check_hf_coverage
from toolkit.models.tiny import tiny_config


def test_registry_lists_supported_model_types_for_unknown_ones():
    decoders = ["deepseek_v2", "deepseek_v3", "gemma", "gemma2", "gemma3_text", "gpt2", "granite", "llama", "mistral",
                "mixtral", "olmo2", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "starcoder2"]
    assert set(decoders) <= set(supported_model_types()) and supported_model_types() == sorted(supported_model_types())
    with pytest.raises(AdapterError, match=r"'gpt_neox'.*supported: " + ", ".join(supported_model_types())):
        get_family("gpt_neox")


def test_a_family_imported_on_its_own_first_does_not_hide_the_others():
    """A fresh interpreter that imports one family file before anything asks the registry (a test, a user's script)
    still sees every family: the registry loads them all once, whatever registered first."""
    import subprocess
    import sys

    code = ("import toolkit.adapters.families.qwen3\n"
            "from toolkit.adapters.family import get_family, supported_model_types\n"
            "get_family('llama'); print(len(supported_model_types()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == len(supported_model_types())


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "granite",
                                        "starcoder2", "olmo2", "gemma2", "gemma3_text"])
def test_table_covers_every_hf_tensor_of_a_real_hf_model(model_type):
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        config = tiny_config(model_type, tie_word_embeddings=tied)
        hf_names = list(AutoModelForCausalLM.from_config(config).state_dict())
        settings = model_settings(config)
        assert settings.tied_embeddings == tied
        items = expand_table(settings.weight_table(), num_layers=config.num_hidden_layers)
        assert check_hf_coverage(items=items, hf_names=hf_names, ignored=settings.ignored_hf()) == []


def test_coverage_check_names_unexpected_and_missing_tensors_together():
    items = expand_table(get_family("llama").weight_table(tied_embeddings=False), num_layers=2)
    names = [n for item in items.values() for n in item.hf if "layers.1.mlp.up_proj" not in n]
    problems = check_hf_coverage(items=items, hf_names=names + ["model.layers.0.self_attn.q_norm.weight"], ignored=())
    assert any("'model.layers.0.self_attn.q_norm.weight' is not used" in p for p in problems)
    assert any("'model.layers.1.mlp.up_proj.weight' is missing" in p for p in problems)
    assert len(problems) == 2


def test_shared_translation_and_family_deltas():
    llama = model_settings(tiny_config("llama"))
    assert llama.transformer_fields["num_query_groups"] == 2
    assert llama.transformer_fields["kv_channels"] == 8
    assert llama.padded_vocab_size == 256 and llama.vocab_size == 250
    assert llama.transformer_fields["add_qkv_bias"] is False and llama.transformer_fields["gated_linear_unit"]
    assert llama.transformer_fields["activation_func"] is torch.nn.functional.silu
    assert model_settings(tiny_config("qwen2")).transformer_fields["add_qkv_bias"] is True


def test_activation_must_be_the_familys():
    with pytest.raises(AdapterError, match=r"hidden_act='gelu'; the llama adapter reproduces only 'silu' / 'swish'"):
        model_settings(tiny_config("llama", hidden_act="gelu"))


def test_rope_llama3_scaling_supported_and_other_kinds_refused():
    scaled = tiny_config("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    assert rope_settings(scaled) == (5e5, {"rope_scaling": True, "rope_scaling_factor": 8.0}, None)
    odd = tiny_config("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192})
    with pytest.raises(AdapterError, match="low_freq_factor"):
        model_settings(odd)
    yarn = tiny_config("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(AdapterError, match="rope_type 'yarn' is not supported"):
        model_settings(yarn)


def test_unreproducible_features_are_refused_by_name():
    with pytest.raises(AdapterError, match="attention_bias=True"):
        model_settings(tiny_config("llama", attention_bias=True))


@pytest.mark.parametrize("model_type, overrides, windowed", [
    ("mistral", dict(sliding_window=16), [1, 1, 1, 1]),  # Mistral v0.1: every layer
    ("phi3", dict(sliding_window=16), [1, 1, 1, 1]),  # Phi-3-mini-4k (2047)
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), [0, 0, 1, 1]),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=3), [0, 0, 0, 1]),
])
def test_sliding_windows_reach_megatron_per_layer(model_type, overrides, windowed):
    """HF's window of w sees w - 1 tokens back and itself: megatron's window_size (w - 1, 0), on the layers HF's
    layer_types marks sliding (megatron's window_attn_skip_freq, 1 = windowed)."""
    fields = model_settings(tiny_config(model_type, **overrides)).transformer_fields
    assert fields["window_size"] == (15, 0) and fields["window_attn_skip_freq"] == windowed


def test_no_window_leaves_megatron_full_causal():
    for model_type, overrides in (("mistral", {}), ("qwen2", dict(sliding_window=16)), ("llama", {})):
        assert "window_size" not in model_settings(tiny_config(model_type, **overrides)).transformer_fields


def test_family_deltas_reach_the_megatron_config():
    from toolkit.adapters.family import gelu_tanh

    fields = {t: model_settings(tiny_config(t)).transformer_fields for t in ("qwen3", "gemma", "phi3", "gpt2")}
    assert fields["qwen3"]["qk_layernorm"] and fields["qwen3"]["kv_channels"] == 16  # head_dim != 64 / 8
    gemma = fields["gemma"]
    assert gemma["activation_func"] is gelu_tanh and gemma["gated_linear_unit"] and gemma["layernorm_zero_centered_gamma"]
    assert gemma["num_query_groups"] == 1 and gemma["kv_channels"] == 16
    assert get_family("gemma").architecture.embedding_scale
    assert fields["phi3"]["activation_func"] is torch.nn.functional.silu and not fields["phi3"]["add_bias_linear"]
    gpt2 = fields["gpt2"]
    assert (gpt2["normalization"], gpt2["gated_linear_unit"], gpt2["add_bias_linear"]) == ("LayerNorm", False, True)
    assert (gpt2["ffn_hidden_size"], gpt2["num_query_groups"], gpt2["layernorm_epsilon"]) == (96, 8, 1e-5)
    assert get_family("gpt2").architecture.position_embedding == "learned_absolute"
    assert model_settings(tiny_config("gpt2", n_inner=None)).transformer_fields["ffn_hidden_size"] == 4 * 64


@pytest.mark.parametrize("model_type,overrides,message", [
    # partial rotary runs (Phi-4-mini: tests/adapters/test_longrope.py) where it rotates an even number of dims
    ("phi3", dict(partial_rotary_factor=0.375), "partial_rotary_factor=0.375: rotates 3 of head_dim 8"),
    ("phi3", dict(resid_pdrop=0.1), "the phi3 adapter trains without dropout"),
    ("gpt2", dict(embd_pdrop=0.1), "embd_pdrop=0.1 != resid_pdrop=0.0"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "only the standard 1/sqrt\\(head_dim\\) attention scale"),
    ("gpt2", dict(activation_function="relu"), "activation_function='relu'; the gpt2 adapter reproduces only"),
    ("gemma", dict(hidden_act="silu"), "hidden_act='silu'; the gemma adapter reproduces only 'gelu_new' / "
                                       "'gelu_pytorch_tanh'"),
])
def test_family_features_megatron_cannot_reproduce_are_refused_by_name(model_type, overrides, message):
    with pytest.raises(AdapterError, match=message):
        model_settings(tiny_config(model_type, **overrides))


def test_gpt2_keeps_its_dropout_as_megatron_hidden_and_attention_dropout():
    fields = model_settings(tiny_config("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.05)).transformer_fields
    assert (fields["hidden_dropout"], fields["attention_dropout"]) == (0.1, 0.05)


def test_verify_says_whether_it_compared_past_the_window():
    from toolkit.verify.worker import window_note

    windowed = model_settings(tiny_config("mistral", sliding_window=16))
    assert window_note(windowed, seq_len=32) == ("seq_len 32 reaches past the sliding window (16): the window "
                                                 "compared")
    assert "inside the sliding window (16): full causal attention" in window_note(windowed, seq_len=16)
    assert window_note(model_settings(tiny_config("llama")), seq_len=32) is None
