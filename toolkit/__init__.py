"""dsmt: DeepSpeed x Megatron-core toolkit."""

__version__ = "0.1.0"
