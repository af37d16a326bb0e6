"""Spec test helpers (tests/spec, tests/check): a tiny inline Llama config and a valid CPU spec to vary."""

from __future__ import annotations

import copy


TINY_CONFIG = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 1000, "hidden_act": "silu", "max_position_embeddings": 256,
}


def tiny_spec(**sections) -> dict:
    """A valid CPU spec (2 ranks, dp 2) with `sections` merged in per key."""
    spec = {
        "model": {"config": copy.deepcopy(TINY_CONFIG)},
        "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64, "precision": "fp32",
                     "train_steps": 5, "warmup_steps": 1, "checkpoint_interval": 5},
        "data": {"synthetic": True},
    }
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    return spec
