"""Family tables, config translation and layout rules: everything checked before a tensor is read."""

import pytest

from toolkit.adapters.family import AdapterError, get_family, supported_model_types
from toolkit.adapters.hf_config import model_settings, rope_settings
from toolkit.adapters.load import check_hf_coverage, expand_table
from toolkit.tiny import tiny_config


def test_registry_lists_supported_model_types_for_unknown_ones():
    assert supported_model_types() == ["llama", "mistral", "qwen2"]
    with pytest.raises(AdapterError, match=r"'gpt_neox'.*supported: llama, mistral, qwen2"):
        get_family("gpt_neox")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_table_covers_every_hf_tensor_of_a_real_hf_model(model_type):
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        config = tiny_config(model_type, tie_word_embeddings=tied)
        hf_names = list(AutoModelForCausalLM.from_config(config).state_dict())
        settings = model_settings(config)
        items = expand_table(settings.family.weight_table(tied_embeddings=tied), num_layers=config.num_hidden_layers)
        ignored = settings.family.ignored_hf + (("lm_head.weight",) if tied else ())
        assert check_hf_coverage(items=items, hf_names=hf_names, ignored=ignored) == []


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
    assert "add_qkv_bias" not in llama.transformer_fields
    assert model_settings(tiny_config("qwen2")).transformer_fields["add_qkv_bias"] is True


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
    with pytest.raises(AdapterError, match="sliding_window=16 < max_position_embeddings=128"):
        model_settings(tiny_config("mistral", sliding_window=16))
    with pytest.raises(AdapterError, match="attention_bias=True"):
        model_settings(tiny_config("llama", attention_bias=True))
    with pytest.raises(AdapterError, match="use_sliding_window=True"):
        model_settings(tiny_config("qwen2", use_sliding_window=True, sliding_window=16))
