"""The training engine: DeepSpeed around megatron-core chunks (`hybrid`), the loss, task heads, MoE and a script's HF batches."""
