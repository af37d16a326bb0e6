"""HF checkpoints <-> megatron-core GPTModel: one registered file per model family (families/), the closed set of
weight transforms, HF config translation, the streaming safetensors reader, and model build + load."""
