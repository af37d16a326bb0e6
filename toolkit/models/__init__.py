"""Models as dsmt sees them, below the adapters: their shapes read from a config (`shapes`, `moe_shapes`; with the
family's layer facts: toolkit/adapters/model_shape.py), folders that would run their own code (`remote_code`), and
tiny random HF checkpoints (`tiny`)."""
