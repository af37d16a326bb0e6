"""`dsmt verify`: HF logits vs the TP x PP sharded megatron-core model's, on the same tokens."""
