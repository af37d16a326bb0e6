"""LoRA: adapters on megatron-core chunks (`adapters`) and PEFT's format in and out (`export`)."""
