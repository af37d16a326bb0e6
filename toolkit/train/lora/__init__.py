"""LoRA: adapters on megatron-core linears (`adapters`), applied to a rank's chunks (`apply`), and PEFT's format in
and out (`export`)."""
