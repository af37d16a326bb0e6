"""`dsmt train`: DeepSpeed ZeRO data parallelism around megatron-core TP/PP modules built by the adapters."""
