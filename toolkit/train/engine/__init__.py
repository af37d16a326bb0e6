"""The training engine: DeepSpeed around megatron-core chunks (`hybrid`), the loss, task heads, mpu, MoE and ZeRO-3 pieces."""
