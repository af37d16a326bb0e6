"""The planner's LoRA count on MoE and multi-latent-attention models (toolkit/plan/lora.py) against dsmt's own count
of the adapters it trains (toolkit/train/lora/targets.py `count_lora_params`): the whole model at ep = 1, pp = 1;
per GPU the routed experts' share over ep and the layers over pp; the model states the adapters add per GPU."""

from __future__ import annotations

import argparse
import json

import pytest

from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.model_shape import load_model_shape, shape_of_hf_config
from toolkit.models.shapes import BUILTIN_SHAPES
from toolkit.models.tiny import tiny_config
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layers import stage_params_per_gpu
from toolkit.plan.layout import PlanLayout, TrainingShape
from toolkit.plan.lora import (LoraShape, default_projections, lora_params, projections_of, stage_lora_params)
from toolkit.plan.memory import stage_memory
from toolkit.adapters.peft_names import peft_redirected_names
from toolkit.train.lora.targets import count_lora_params, resolve_targets

BF16 = Assumptions.for_precision("bf16")
RANK = 8
MODELS = [("qwen3_moe", {}), ("mixtral", {}), ("deepseek_v2", {}), ("deepseek_v2", {"q_lora_rank": 24}),
          ("qwen2_moe", {})]


def _default_lora(config) -> LoraShape:
    """training.lora with targets unset, as `dsmt check` hands it to the planner (checks.py `_lora_shape`)."""
    settings = model_settings(config)
    modules = resolve_targets(settings.family, None, rows=settings.rows)
    return LoraShape(rank=RANK, projections=frozenset(
        p for m in modules for p in projections_of(linear=m.linear, kind=m.kind.value, slot=m.slot)))


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m[0] + "".join(f"-{k}" for k in m[1]))
def model(request):
    model_type, overrides = request.param
    config = tiny_config(model_type, **overrides)
    return config, shape_of_hf_config(config), _default_lora(config)


def test_whole_model_count_is_dsmts(model):
    config, shape, lora = model
    expected = count_lora_params(config, rank=RANK, targets=None)
    assert lora_params(shape=shape, lora=lora) == expected
    one_gpu = stage_lora_params(shape=shape, lora=lora, layout=PlanLayout(tp=1, pp=1, dp=1), stage=0)
    assert one_gpu.total == expected and one_gpu.experts > 0
    # the CLI's default (no family at hand: PEFT's redirected names decide) is the same set of targets
    redirected = bool(peft_redirected_names(config.model_type) - {"gate"})
    assert default_projections(shape, mlp_names_redirected=redirected) == lora.projections


def test_a_named_router_is_counted_on_every_moe_layer():
    """The router takes an adapter only when a target names it (mlp.gate.weight): [E, h] per MoE layer, with the
    dense adapters (replicated over EP)."""
    config = tiny_config("deepseek_v2")
    targets = ["q_proj", "mlp.gate.weight", "experts.down_proj"]
    settings = model_settings(config)
    modules = resolve_targets(settings.family, targets, rows=settings.rows)
    lora = LoraShape(rank=RANK, projections=frozenset(
        p for m in modules for p in projections_of(linear=m.linear, kind=m.kind.value, slot=m.slot)))
    assert "router" in lora.projections
    shape = shape_of_hf_config(config)
    assert lora_params(shape=shape, lora=lora) == count_lora_params(config, rank=RANK, targets=targets)
    without = LoraShape(rank=RANK, projections=lora.projections - {"router"})
    router = RANK * (shape.hidden_size + shape.num_experts) * shape.num_moe_layers
    assert lora_params(shape=shape, lora=lora) - lora_params(shape=shape, lora=without) == router


def test_ep_halves_the_routed_experts_share_and_tp_splits_nothing(model):
    _, shape, lora = model
    whole = stage_lora_params(shape=shape, lora=lora, layout=PlanLayout(tp=1, pp=1, dp=2), stage=0)
    halved = stage_lora_params(shape=shape, lora=lora, layout=PlanLayout(tp=2, pp=1, dp=2, ep=2), stage=0)
    assert halved.experts * 2 == whole.experts and halved.dense == whole.dense


def test_stages_sum_to_the_whole_model(model):
    _, shape, lora = model
    layout = PlanLayout(tp=1, pp=2, dp=1)
    stages = [stage_lora_params(shape=shape, lora=lora, layout=layout, stage=s).total for s in range(2)]
    assert sum(stages) == lora_params(shape=shape, lora=lora)


def test_deepseek_v2_lite_by_hand():
    """The tiny DeepSeek-V2-Lite (toolkit/models/tiny.py): h 64, 8 heads, nope / rope / v 16 / 8 / 16, kv latent 32,
    no q latent; layer 0 dense (its MLP withheld: PEFT reads gate_proj as the experts), layers 1-3 MoE with 4
    experts of width 32 (shared experts withheld likewise)."""
    config = tiny_config("deepseek_v2")
    shape, lora = shape_of_hf_config(config), _default_lora(config)
    attention = (64 + 8 * 24) + (64 + 32 + 8) + (32 + 8 * (16 + 16)) + (8 * 16 + 64)  # q, kv_a, kv_b, o: 840
    expert = (64 + 2 * 32) + (32 + 64)  # gate_up [64, 64], down [64, 32]: 224
    assert lora.projections == {"q", "kv_a", "kv_b", "o", "expert_gate_up", "expert_down"}
    assert lora_params(shape=shape, lora=lora) == RANK * (4 * attention + 3 * 4 * expert)
    stage0 = stage_lora_params(shape=shape, lora=lora, layout=PlanLayout(tp=1, pp=2, dp=2, ep=2), stage=0)
    assert (stage0.dense, stage0.experts) == (RANK * 2 * attention, RANK * 1 * 2 * expert)  # layers 0 (dense), 1


@pytest.mark.parametrize("ep", [1, 2])
def test_lora_states_per_gpu_follow_ep(ep):
    """BF16 at ZeRO-1 (toolkit/plan/model_states.py): the adapters' fp32 gradients whole on every rank, their fp32
    master and Adam moments partitioned, the dense adapters' over dp × cp = 4, the routed experts' over
    expert_dp = 4 / ep. Per GPU at ep = 2 the experts' gradients halve; their optimizer state stays (E / ep experts
    over dp / ep ranks)."""
    config = tiny_config("deepseek_v2")
    shape, lora = shape_of_hf_config(config), _default_lora(config)
    layout = PlanLayout(tp=1, pp=1, dp=4, ep=ep, zero_stage=1)
    memory = stage_memory(shape=shape, layout=layout, stage=0, assumptions=BF16,
                          training=TrainingShape(seq_length=64, global_batch_size=8, lora=lora))
    dense, experts = RANK * 4 * 840, RANK * 3 * (4 // ep) * 224  # 26880; 21504 at ep 1, 10752 at ep 2
    assert memory.gradients == BF16.master_grad_bytes * (dense + experts)
    assert memory.optimizer == BF16.optimizer_bytes_per_param * (dense // 4 + experts // (4 // ep))
    assert memory.optimizer == BF16.optimizer_bytes_per_param * (6720 + 5376)  # the same at ep 1 and 2
    base = stage_params_per_gpu(shape=shape, layout=layout, stage=0)
    assert memory.parameters == BF16.param_bytes * (base + dense + experts)
    assert memory.params_per_gpu == base + dense + experts


def test_cli_default_targets(tmp_path):
    """`dsmt plan --lora-rank` counts dsmt's default targets: Qwen2-MoE's shared expert and dense MLP with its
    experts; DeepSeek's experts and MLA without its shared experts; a built-in shape every projection it has."""
    from toolkit.plan.cli import _lora

    for model_type in ("qwen2_moe", "deepseek_v3"):
        config = tiny_config(model_type)
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config.to_dict()))
        lora = _lora(argparse.Namespace(lora_rank=RANK, model=str(folder)), load_model_shape(str(folder)))
        assert lora.projections == _default_lora(config).projections
    builtin = _lora(argparse.Namespace(lora_rank=RANK, model="deepseek-v3"), BUILTIN_SHAPES["deepseek-v3"])
    assert builtin.projections == {"q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down", "shared_gate",
                                   "shared_up", "shared_down", "expert_gate_up", "expert_down"}
