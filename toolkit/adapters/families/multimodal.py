"""Multimodal checkpoints trained on their language model (Gemma 3, Mistral 3, Qwen2.5-VL `...ForConditionalGeneration`):
registered from toolkit/adapters/multimodal.py, which holds their table and says why."""

from toolkit.adapters.multimodal import REGISTERED  # noqa: F401 (importing it registers the families)
