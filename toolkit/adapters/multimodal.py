"""Multimodal checkpoints fine-tuned on their text: Gemma 3 4B / 12B / 27B (`gemma3`), Mistral-Small-3.1 / 3.2
(`mistral3`), Qwen2.5-VL (`qwen2_5_vl`) and Llama 4 Scout / Maverick (`llama4`) ship as
`...ForConditionalGeneration`, a vision tower and a projector around a language model that is exactly a text family
dsmt already has (gemma3_text, mistral, qwen2, llama4_text). dsmt trains that language model on text records, and
carries every other tensor through conversion, training and export bit for bit, so the exported folder loads as
the same multimodal class with the same vision weights.

What differs from the text family, all of it in the table below (`WRAPPERS`):

* The config: the text family reads `config.text_config`; the wrapper's own config says only whether the output
  layer is tied to the embeddings (transformers ties by the outer `tie_word_embeddings`, which Mistral3Config
  defaults to True, and unties a pair the checkpoint stores both of: `multimodal_settings`).
* The tensor names: the text family's `model.*` live under a prefix and `lm_head.weight` may move. Checkpoints come
  in two namings, both read and written back as found: the one `save_pretrained` writes (transformers 5 saves the
  published layout: `language_model.model.*`, `vision_tower.*`; Qwen2.5-VL `model.*`, `visual.*`) and transformers
  5's module names (`model.language_model.*`, `model.vision_tower.*`). `NameLayout.of` tells them apart by the
  embedding's name; without names (a config alone) the saved one is assumed.
* Text-only forward of the multimodal class is the text model's: no pixel values, no image features merged.
  Qwen2.5-VL's multimodal RoPE (`mrope_section`) gives text-only positions the same index in its three sections, so
  it is plain 1D RoPE (tests/adapters/test_family_multimodal.py checks it against transformers' own module).
  Gemma3ForConditionalGeneration computes its logits without the final-logit softcap, so a text config that sets
  one is refused rather than guessed.

An unknown multimodal model_type (llava, idefics3, ...) has no entry here and stays refused by `get_family`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from toolkit.adapters.families.gemma3 import GEMMA3_TEXT
from toolkit.adapters.families.llama4 import LLAMA4_TEXT
from toolkit.adapters.families.mistral import MISTRAL
from toolkit.adapters.families.qwen2 import QWEN2
from toolkit.adapters.family import AdapterError, ModelFamily, WeightMapping, register
from toolkit.adapters.hf_config import DEFAULT_VOCAB_PAD_MULTIPLE, ModelSettings, model_settings

TEXT_PREFIX = "model."  # how the text families' tables name the language model's tensors
TEXT_LM_HEAD = "lm_head.weight"
TEXT_EMBEDDING = "model.embed_tokens.weight"


@dataclasses.dataclass(frozen=True)
class NameLayout:
    """One naming of a multimodal checkpoint: where the language model's tensors are, and every other tensor (with
    `*` a number and a trailing `.*` any rest, as `ModelSettings.passthrough_hf`)."""

    text_prefix: str  # stands for the text family's leading `model.`
    lm_head: str
    passthrough: tuple[str, ...]

    def hf_name(self, text_name: str) -> str:
        """The checkpoint's name of a tensor the text family's table names `text_name`."""
        if text_name == TEXT_LM_HEAD:
            return self.lm_head
        if text_name.startswith(TEXT_PREFIX):
            return self.text_prefix + text_name.removeprefix(TEXT_PREFIX)
        raise AdapterError(f"text family tensor {text_name!r} is neither {TEXT_PREFIX}* nor {TEXT_LM_HEAD}: the "
                           "multimodal naming (toolkit/adapters/multimodal.py) cannot place it")

    def rows(self, rows: tuple[WeightMapping, ...]) -> tuple[WeightMapping, ...]:
        return tuple(dataclasses.replace(row, hf=tuple(self.hf_name(name) for name in row.hf)) for row in rows)

    @staticmethod
    def of(layouts: tuple[NameLayout, ...], tensor_names) -> NameLayout:
        """The layout whose embedding the checkpoint holds; the first (the saved naming) without names or a match
        (the coverage check then lists what is missing)."""
        names = set(tensor_names or ())
        return next((layout for layout in layouts if layout.hf_name(TEXT_EMBEDDING) in names), layouts[0])


# transformers' `llava`-style naming (Gemma 3, Mistral 3): saved, then module names.
_LLAVA_LAYOUTS = (
    NameLayout("language_model.model.", "language_model.lm_head.weight", ("vision_tower.*", "multi_modal_projector.*")),
    NameLayout("model.language_model.", "lm_head.weight", ("model.vision_tower.*", "model.multi_modal_projector.*")),
)
# Llama 4's naming: its modules hold the text model as `language_model` (a Llama4ForCausalLM) beside
# `vision_model` and `multi_modal_projector`, saved under those names.
_LLAMA4_LAYOUTS = (
    NameLayout("language_model.model.", "language_model.lm_head.weight", ("vision_model.*", "multi_modal_projector.*")),
)
# Qwen2-VL's naming: saved as a Qwen2 text model beside `visual.*`, then module names.
_QWEN_VL_LAYOUTS = (
    NameLayout("model.", "lm_head.weight", ("visual.*",)),
    NameLayout("model.language_model.", "lm_head.weight", ("model.visual.*",)),
)


def check_gemma3_wrapper(hf_config) -> list[str]:
    softcap = getattr(hf_config.text_config, "final_logit_softcapping", None)
    if softcap:
        return [f"text_config.final_logit_softcapping={softcap}: Gemma3ForConditionalGeneration computes its logits "
                "without it (Gemma3ForCausalLM applies it), so which one the checkpoint means is unclear; released "
                "Gemma 3 sets null: set it to null"]
    return []


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A multimodal class whose language model dsmt trains: its model_type, HF class (exported config.json keeps
    it, verify loads it), the text config's model_type and the family that reads it, its namings (saved first)."""

    model_type: str
    hf_architecture: str
    text_model_type: str  # config.text_config.model_type
    text_family: ModelFamily
    layouts: tuple[NameLayout, ...]
    check_config: Callable[[object], list[str]] = lambda hf_config: []


WRAPPERS = (
    Wrapper("gemma3", "Gemma3ForConditionalGeneration", "gemma3_text", GEMMA3_TEXT, _LLAVA_LAYOUTS,
            check_config=check_gemma3_wrapper),
    Wrapper("mistral3", "Mistral3ForConditionalGeneration", "mistral", MISTRAL, _LLAVA_LAYOUTS),
    # Qwen2_5_VLTextModel is Qwen2's layer (q / k / v biases, SwiGLU, RMSNorm) with multimodal RoPE, 1D on text.
    Wrapper("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text", QWEN2, _QWEN_VL_LAYOUTS),
    # Llama4ForConditionalGeneration embeds the text with its language model's table and runs that model as it is.
    Wrapper("llama4", "Llama4ForConditionalGeneration", "llama4_text", LLAMA4_TEXT, _LLAMA4_LAYOUTS),
)


def wrapper_family(wrapper: Wrapper, *, layout: NameLayout) -> ModelFamily:
    """The text family under the wrapper's model_type and class, its table in `layout`'s names."""
    text = wrapper.text_family
    return dataclasses.replace(
        text, model_type=wrapper.model_type, hf_architecture=wrapper.hf_architecture,
        weights=layout.rows(text.weights), untied_output=layout.rows((text.untied_output,))[0],
        ignored_hf=tuple(layout.hf_name(name) for name in text.ignored_hf),
        read_passthrough=lambda hf_config: layout.passthrough,
        read_weights=None if text.read_weights is None else lambda hf_config: layout.rows(text.read_weights(hf_config)),
        multimodal_settings=functools.partial(multimodal_settings, wrapper=wrapper))


def multimodal_settings(hf_config, *, wrapper: Wrapper, vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE,
                        tensor_names=None) -> ModelSettings:
    """The language model's settings (its text family reading `text_config`), renamed into the checkpoint's naming
    (`tensor_names`: the checkpoint's HF tensors where known), every other tensor passed through."""
    text_config = hf_config.text_config
    problems = wrapper.check_config(hf_config)
    if text_config.model_type != wrapper.text_model_type:
        problems.append(f"text_config.model_type={text_config.model_type!r}: dsmt trains the {wrapper.model_type} "
                        f"language model of type {wrapper.text_model_type!r} only")
    if problems:
        raise AdapterError(f"{wrapper.model_type} config uses features dsmt cannot reproduce:\n  - "
                           + "\n  - ".join(problems))
    text = model_settings(text_config, vocab_pad_multiple=vocab_pad_multiple, family=wrapper.text_family)
    layout = NameLayout.of(wrapper.layouts, tensor_names)
    # transformers ties by the outer flag, and leaves a pair the checkpoint stores both of untied (when they differ)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and layout.lm_head not in set(tensor_names or ())
    return dataclasses.replace(
        text, family=wrapper_family(wrapper, layout=layout), tied_embeddings=tied,
        passthrough_hf=layout.passthrough + tuple(layout.hf_name(name) for name in text.passthrough_hf),
        rows=None if text.rows is None else layout.rows(text.rows))


def text_model_fields(config: dict) -> dict:
    """A config.json's fields of the model dsmt builds: a multimodal one's language model (read through
    transformers, which fills the defaults a published text_config leaves out, and turns Qwen2.5-VL's flat
    fields into its text_config), with the outer tie flag; any other config as it is."""
    if config.get("model_type") not in REGISTERED:
        return config
    from transformers import AutoConfig

    full = AutoConfig.for_model(**config)
    return {**full.text_config.to_dict(), "tie_word_embeddings": bool(getattr(full, "tie_word_embeddings", False))}


REGISTERED = {wrapper.model_type: register(wrapper_family(wrapper, layout=wrapper.layouts[0])) for wrapper in WRAPPERS}
