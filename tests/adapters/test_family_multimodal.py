"""Multimodal checkpoints trained on their language model (toolkit/adapters/multimodal.py), one process: the text
family reads `text_config`, the table follows the checkpoint's naming and tying as transformers does, every other
tensor passes through, the refusals name their field, and Qwen2.5-VL's multimodal RoPE is 1D RoPE on text. Logits
at TP x PP, round trips and training parity need megatron's ranks (see the report of issue 49 part 6)."""

import json

import pytest
import torch

from toolkit.adapters.family import AdapterError, get_family
from toolkit.adapters.hf_config import load_hf_config, model_settings
from toolkit.adapters.load import check_hf_coverage
from toolkit.adapters.model_shape import shape_from_config
from toolkit.adapters.multimodal import WRAPPERS
from toolkit.models.tiny_multimodal import tiny_multimodal_config

WRAPPER = {wrapper.model_type: wrapper for wrapper in WRAPPERS}
MODEL_TYPES = ("gemma3", "mistral3", "qwen2_5_vl", "llama4")
# what `save_pretrained` (transformers 5) writes, and transformers 5's module names
SAVED = {"gemma3": "language_model.model.", "mistral3": "language_model.model.", "qwen2_5_vl": "model.",
         "llama4": "language_model.model."}
MODULE = "model.language_model."  # Llama 4's module names are its saved names (transformers 5 kept them)
MODULES = {"llama4": "language_model.model."}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_text_family_reads_text_config(model_type):
    config = tiny_multimodal_config(model_type)
    wrapper = WRAPPER[model_type]
    settings = model_settings(config)
    text = model_settings(config.text_config, family=wrapper.text_family)
    assert settings.transformer_fields == text.transformer_fields and settings.quirks == text.quirks
    assert (settings.rotary_base, settings.rope_scaling, settings.vocab_size) == (text.rotary_base, text.rope_scaling, 250)
    assert settings.family.model_type == model_type and settings.family.hf_architecture == wrapper.hf_architecture
    assert get_family(model_type).multimodal_settings is not None  # registered: trained through megatron-core
    assert settings.tied_embeddings == (model_type == "gemma3")
    names = [name for row in settings.weight_table() for name in row.hf]
    assert all(name.startswith(SAVED[model_type]) or name == wrapper.layouts[0].lm_head for name in names)


def test_both_namings_cover_the_checkpoint_and_every_other_tensor_passes_through(tmp_path):
    """The names `save_pretrained` writes and transformers 5's module names (its state_dict), each read as found."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    for model_type in MODEL_TYPES:
        config = tiny_multimodal_config(model_type)
        model = AutoModelForImageTextToText.from_config(config)
        model.save_pretrained(tmp_path / model_type)
        with safe_open(str(tmp_path / model_type / "model.safetensors"), "pt") as handle:
            saved = list(handle.keys())
        modules = [name for name in model.state_dict() if not (config.tie_word_embeddings and name == "lm_head.weight")]
        for names, prefix in ((saved, SAVED[model_type]), (modules, MODULES.get(model_type, MODULE))):
            settings = model_settings(config, tensor_names=names)
            assert settings.family.weights[0].hf == (prefix + "embed_tokens.weight",), model_type
            assert check_hf_coverage(items=settings.load_items(), hf_names=names, ignored=settings.ignored_hf(),
                                     passthrough=settings.passthrough_hf) == [], (model_type, prefix)
            text_rows = {name for item in settings.load_items().values() for name in item.hf}
            assert len(set(names) - text_rows) > 10  # the vision tower and projector: passed through


def test_tying_is_the_outer_flag_unless_the_checkpoint_stores_both():
    """transformers ties by the wrapper's tie_word_embeddings (Mistral3Config defaults it to True) and leaves a pair
    the checkpoint stores both of untied."""
    config = tiny_multimodal_config("mistral3")
    config.tie_word_embeddings = True
    assert model_settings(config).tied_embeddings
    names = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"]
    assert not model_settings(config, tensor_names=names).tied_embeddings
    assert model_settings(config, tensor_names=names[:1]).tied_embeddings


@pytest.mark.parametrize("model_type,edit,named", [
    ("gemma3", dict(final_logit_softcapping=3.0), "text_config.final_logit_softcapping=3.0"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),  # gemma3_text's own refusal
    ("mistral3", dict(model_type="llama"), "text_config.model_type='llama'"),
    ("mistral3", dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_refusals_name_the_field(model_type, edit, named):
    from transformers import AutoConfig

    config = tiny_multimodal_config(model_type).to_dict()
    config["text_config"].update(edit)
    with pytest.raises(AdapterError, match=named.replace(".", r"\.").replace("(", r"\(")):
        model_settings(AutoConfig.for_model(**config))


def test_an_unknown_multimodal_model_type_stays_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}))
    with pytest.raises(AdapterError, match="'llava' has no megatron-core adapter"):
        load_hf_config(tmp_path)


def test_multimodal_rope_on_text_positions_is_1d_rope():
    """Qwen2.5-VL's text-only positions are the same in its temporal / height / width sections, so its cos / sin
    equal Qwen2's plain RoPE bit for bit (with the released mrope_section and head_dim)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    shape = dict(hidden_size=3584, num_attention_heads=28, max_position_embeddings=256)
    multimodal = Qwen2_5_VLRotaryEmbedding(Qwen2_5_VLTextConfig(
        **shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}))
    plain = Qwen2RotaryEmbedding(Qwen2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    x, positions = torch.zeros(2, 200, 128), torch.arange(200).expand(2, -1)
    for ours, theirs in zip(multimodal(x, positions), plain(x, positions)):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)


def test_published_configs_read_through_transformers_defaults():
    """A published config leaves the text model's defaults out (Gemma 3 4B's text_config names no heads) or is flat
    (Qwen2.5-VL, with `rope_scaling` type mrope): the shape and the settings read them as transformers does."""
    from transformers import AutoConfig

    gemma = {"model_type": "gemma3", "mm_tokens_per_image": 256, "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}, "vision_config": {
        "model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    shape = shape_from_config(gemma, name="gemma-3-4b")
    assert (shape.num_attention_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size) == (8, 4, 256, 262208)
    assert shape.tied_embeddings and shape.num_layers == 34
    settings = model_settings(AutoConfig.for_model(**gemma))
    assert settings.rope_scaling == {"linear_factor": 8.0} and settings.quirks["local_rope_theta"] == 10000.0
    qwen = {"model_type": "qwen2_5_vl", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 250, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
            "use_sliding_window": False, "sliding_window": 32768, "tie_word_embeddings": False,
            "vision_config": {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2}}
    shape = shape_from_config(qwen, name="qwen2.5-vl")
    assert (shape.hidden_size, shape.num_layers, shape.qkv_bias, shape.tied_embeddings) == (64, 4, True, False)
    settings = model_settings(AutoConfig.for_model(**qwen))
    assert settings.rotary_base == 1e6 and settings.rope_scaling is None and "window_size" not in settings.transformer_fields


def test_the_processor_travels_with_the_checkpoint():
    from toolkit.convert.checkpoint import HF_SIDE_FILES

    assert {"preprocessor_config.json", "processor_config.json"} <= set(HF_SIDE_FILES)


def test_lora_is_refused_by_name():
    """A PEFT adapter of the multimodal class would need its module paths and targets limited to the language
    model; until dsmt writes those, LoRA on these checkpoints is refused."""
    from toolkit.train.lora.targets import LoraFamilyError, resolve_targets

    with pytest.raises(LoraFamilyError, match="training.lora on gemma3: a multimodal checkpoint"):
        resolve_targets(get_family("gemma3"), None)
