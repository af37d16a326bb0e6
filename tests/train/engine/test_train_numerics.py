"""The engine's numerics settings, each checked where DeepSpeed / megatron really act on them (one process).

- bf16 accumulates gradients and reduces them over data parallelism in fp32 at every ZeRO stage: the generated
  DeepSpeed config says so and DeepSpeed's engine, built from it, really holds fp32 gradient buffers.
- fp16 with PP > 1 and 16-bit training without ZeRO are refused before launch, by rule name.
- weight decay spares 1-D parameters (norms, biases); the tied embedding copy counts once in the grad norm;
  an engine that still manages accumulation at PP > 1 is refused.
"""

import types

import pytest
import torch

from toolkit.errors import DsmtError
from toolkit.generate.deepspeed_config import build_deepspeed_config
from toolkit.spec.layout import derive_layout
from toolkit.check.checks import run_checks
from toolkit.spec.load import validate_spec
from toolkit.train.engine.hybrid import accumulated_grad, check_driver, mark_tied_output_copies, weight_decay_groups

BASE = {
    "model": {"config": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 256}},
    "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64, "precision": "bf16",
                 "train_steps": 5, "warmup_steps": 1, "checkpoint_interval": 5},
    "data": {"synthetic": True},
}


@pytest.fixture(autouse=True)
def _launcher_env(monkeypatch):
    # DeepSpeed's engine reads the launcher's LOCAL_RANK even in a one-process group
    monkeypatch.setenv("LOCAL_RANK", "0")


def spec_with(**sections):
    import copy

    raw = copy.deepcopy(BASE)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def check_spec(raw: dict):
    return run_checks(spec=validate_spec(raw, source="test"))


def ds_config_for(raw: dict) -> dict:
    spec = validate_spec(raw, source="test")
    return build_deepspeed_config(spec=spec, layout=derive_layout(spec))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_config_accumulates_and_reduces_in_fp32(zero):
    config = ds_config_for(spec_with(parallel={"zero_stage": zero}))
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["communication_data_type"] == "fp32"
    assert config["bf16"] == {"enabled": True, "immediate_grad_update": True}


def test_spec_can_choose_16_bit_accumulation_and_reduction():
    config = ds_config_for(spec_with(communication={"grad_accum_dtype": "bf16", "communication_data_type": "bf16"}))
    assert config["data_types"] == {"grad_accum_dtype": "bf16"} and config["communication_data_type"] == "bf16"


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_engine_really_holds_fp32_gradients_under_bf16(zero):
    """DeepSpeed picks its optimizer from the config: ZeRO-1 -> BF16_Optimizer with fp32 gradient buffers;
    ZeRO-2 a separate fp32 accumulation buffer; ZeRO-3 fp32 gradient partitions."""
    import deepspeed

    from toolkit.launch.local import single_process_group

    config = ds_config_for(spec_with(parallel={"zero_stage": zero}))
    config.update(train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0 if zero == 3 else None
    config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items() if v is not None}
    with single_process_group(dist_backend="gloo"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert engine.communication_data_type == torch.float32
        assert engine.get_data_types() == (torch.bfloat16, torch.float32)
        optimizer = engine.optimizer
        if zero == 1:
            assert type(optimizer).__name__ == "BF16_Optimizer"
            assert all(g.dtype == torch.float32 for group in optimizer.fp32_groups_gradients for g in group)
        elif zero == 2:
            assert optimizer.use_separate_grad_accum and optimizer.gradient_accumulation_dtype == torch.float32
        else:
            assert optimizer.gradient_accumulation_dtype == torch.float32
        engine.destroy()


@pytest.mark.parametrize("sections, rule", [
    (dict(parallel={"pp": 2, "zero_stage": 1}, training={"precision": "fp16"}, cluster={"device": "cuda", "gpu": "h100-80gb", "gpus_per_node": 2}),
     "fp16_with_pp"),
    (dict(parallel={"zero_stage": 0}), "fp32_accumulation_needs_zero"),
    (dict(communication={"grad_accum_dtype": "fp16"}), "grad_accum_dtype"),
])
def test_unsupported_precision_layouts_are_refused_by_rule(sections, rule):
    report = check_spec(spec_with(**sections))
    errors = [p for p in report.problems if p.severity == "error"]
    assert rule in [p.rule for p in errors], report.to_text()
    problem = next(p for p in errors if p.rule == rule)
    assert problem.fix  # each names its fix


def test_zero0_bf16_is_accepted_when_16_bit_accumulation_is_chosen():
    report = check_spec(spec_with(parallel={"zero_stage": 0}, communication={"grad_accum_dtype": "bf16"}))
    assert "fp32_accumulation_needs_zero" not in [p.rule for p in report.problems]


def test_weight_decay_spares_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=True), torch.nn.LayerNorm(4), torch.nn.Embedding(3, 4))
    decay, no_decay = weight_decay_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}


def test_only_the_last_stage_copy_of_a_tied_embedding_is_marked_replicated():
    def chunk(pre, post):
        return types.SimpleNamespace(pre_process=pre, post_process=post,
                                     output_layer=types.SimpleNamespace(weight=torch.nn.Parameter(torch.zeros(2))))

    first, middle, last = chunk(True, False), chunk(False, False), chunk(False, True)
    mark_tied_output_copies([first, middle, last])
    assert getattr(last.output_layer.weight, "ds_pipe_replicated", False)
    assert not hasattr(first.output_layer.weight, "ds_pipe_replicated")
    assert not hasattr(middle.output_layer.weight, "ds_pipe_replicated")


def test_tied_gradient_is_found_where_deepspeed_keeps_it():
    param = torch.nn.Parameter(torch.zeros(2))
    param._hp_grad = torch.ones(2)  # BF16_Optimizer's fp32 buffer after immediate_grad_update freed .grad
    assert accumulated_grad(param) is param._hp_grad
    param.grad = torch.full((2,), 3.0)
    assert accumulated_grad(param) is param.grad
    with pytest.raises(DsmtError, match="tied embedding"):
        accumulated_grad(torch.nn.Parameter(torch.zeros(2)))


@pytest.mark.parametrize("engine", [
    types.SimpleNamespace(managed_gradient_accumulation=lambda: True, _unmanaged_backward_count=0),
    types.SimpleNamespace(),  # a DeepSpeed before 0.19.4: no such setting at all
])
def test_pipeline_driver_refuses_an_engine_that_manages_accumulation(engine):
    with pytest.raises(DsmtError, match="deepspeed>=0.19.4"):
        check_driver(engine, pp_size=2)
    check_driver(engine, pp_size=1)  # the DeepSpeed loop at PP = 1 does not need it


def test_the_installed_deepspeed_runs_unmanaged_at_pp_above_1():
    """A real engine from the config the PP > 1 driver uses passes the driver check (and DeepSpeed < 0.19.4,
    which ignores the key, would not: see the test above)."""
    import deepspeed

    from toolkit.launch.local import single_process_group
    from toolkit.train.engine.hybrid import engine_config

    config = ds_config_for(spec_with(training={"precision": "fp32"}))
    config.update(train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    with single_process_group(dist_backend="gloo"):
        model = torch.nn.Linear(4, 4)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=engine_config(config, pp_size=2))
        assert not engine.managed_gradient_accumulation()
        check_driver(engine, pp_size=2)
        engine.destroy()


def test_weight_decay_groups_use_the_full_shape_of_zero3_partitioned_parameters():
    """Under ZeRO-3 every parameter's data is a flat 1-D shard; its real shape is `ds_shape`."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = param.data.reshape(-1)  # what a partitioned parameter looks like
    decay, no_decay = weight_decay_groups(model, weight_decay=0.1)
    assert {id(p) for p in decay["params"]} == {id(model[0].weight)}
    assert len(no_decay["params"]) == 3
