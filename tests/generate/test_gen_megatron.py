"""megatron.json names only real megatron-core fields, and megatron-core accepts the values."""

import dataclasses
import inspect
import json

import pytest

from gen_helpers import VARIANTS, render

torch = pytest.importorskip("torch")
transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")

# MLATransformerConfig (DeepSeek's multi-latent attention) is TransformerConfig plus MLA's widths
FIELDS = {f.name for f in dataclasses.fields(transformer_config.MLATransformerConfig)}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_transformer_config_keys_are_dataclass_fields(name):
    settings = json.loads(render(name)["megatron.json"])
    assert set(settings["transformer_config"]) - FIELDS == set()
    schedule_args = set(inspect.signature(schedules.forward_backward_no_pipelining).parameters)
    assert set(settings["schedule"]) - schedule_args == set()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_transformer_config_constructs(name):
    values = json.loads(render(name)["megatron.json"])["transformer_config"]
    for key in ("params_dtype", "pipeline_dtype"):
        values[key] = getattr(torch, values[key])
    mla = values.get("multi_latent_attention", False)
    config = (transformer_config.MLATransformerConfig if mla else transformer_config.TransformerConfig)(**values)
    assert config.tensor_model_parallel_size == values["tensor_model_parallel_size"]
