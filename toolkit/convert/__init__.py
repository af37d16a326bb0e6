"""Conversion between HF checkpoints and dsmt's layout-free megatron-core checkpoints."""
