"""Tiny random multimodal checkpoints (Gemma 3, Mistral 3, Qwen2.5-VL, Llama 4 `...ForConditionalGeneration`) for
the tests of toolkit/adapters/multimodal.py: the language model is the text family's tiny one (toolkit/models/tiny.py), the vision
tower a one-layer toy on 28-56 pixel images, every norm weight and bias randomised as `make_tiny_checkpoint` does.
Saved with `save_pretrained`, so the tensor names are the ones transformers writes; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models.tiny import _save_tiny_tokenizer, tiny_config

# Per multimodal model_type: the text family's tiny config (and the model_type its text_config carries), the tiny
# vision tower, the wrapper's own fields (special tokens inside the tiny vocabulary of 250, the tying as released:
# Gemma 3 tied, Mistral 3 and Qwen2.5-VL untied).
_TINY_MULTIMODAL = {
    "gemma3": dict(
        text=("gemma3_text", "gemma3_text"),
        vision=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=2, image_size=28, patch_size=14, vision_use_head=False),
        # 2 x 2 patches pooled into one image token
        fields=dict(mm_tokens_per_image=1, boi_token_index=247, eoi_token_index=248, image_token_index=249,
                    tie_word_embeddings=True)),
    "mistral3": dict(
        text=("mistral", "mistral"),
        vision=dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=2, head_dim=16, image_size=56, patch_size=14),
        fields=dict(image_token_index=249, spatial_merge_size=2, tie_word_embeddings=False)),
    "qwen2_5_vl": dict(
        text=("qwen2", "qwen2_5_vl_text"),
        # multimodal RoPE: temporal / height / width sections of the tiny head_dim's 4 frequencies
        text_fields=dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
        fields=dict(image_token_id=249, video_token_id=248, vision_start_token_id=246, vision_end_token_id=247,
                    tie_word_embeddings=False)),
    # Llama 4: a one-layer vision tower on 28-pixel images, its pixel-shuffle MLP 4 x hidden wide as released.
    "llama4": dict(
        text=("llama4_text", "llama4_text"),
        vision=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
        fields=dict(boi_token_index=247, eoi_token_index=248, image_token_index=249, tie_word_embeddings=False)),
}


def tiny_multimodal_config(model_type: str):
    from transformers import AutoConfig

    if model_type not in _TINY_MULTIMODAL:
        raise ValueError(f"no tiny multimodal config for {model_type!r}; known: {', '.join(_TINY_MULTIMODAL)}")
    entry = _TINY_MULTIMODAL[model_type]
    text_family, text_model_type = entry["text"]
    text = {**tiny_config(text_family).to_dict(), "model_type": text_model_type, **entry.get("text_fields", {})}
    return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(entry["vision"]), **entry["fields"])


def make_tiny_multimodal_checkpoint(path: Path, *, model_type: str, seed: int = 0,
                                    dtype: torch.dtype = torch.float32) -> Path:
    """Save a randomly initialised tiny `...ForConditionalGeneration` of `model_type` (gemma3, mistral3, qwen2_5_vl,
    llama4) with the tiny character tokenizer to `path`; return the path."""
    from transformers import AutoModelForImageTextToText

    config = tiny_multimodal_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF initialises norms to 1 (or 0): randomise them, so a wrong mapping shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("feed_forward.router.weight"):  # Llama 4's router: decisive routing, as tiny.py's
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(path)
    _save_tiny_tokenizer(path, vocab_size=config.text_config.vocab_size)
    return Path(path)
