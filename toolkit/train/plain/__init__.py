"""Models without a megatron-core adapter: DeepSpeed ZeRO data parallelism only (`engine`), synthetic inputs (`synthetic`)."""
