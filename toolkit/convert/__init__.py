"""Conversion between HF checkpoints and dsmt's layout-free megatron-core checkpoints, and this rank's GPTModel chunks loaded from either (`chunks`)."""
