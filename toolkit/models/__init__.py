"""Models as dsmt sees them: their shapes read from a config (`shapes`) and this rank's megatron-core chunks with a checkpoint's weights (`chunks`)."""
