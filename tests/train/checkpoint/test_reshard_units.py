"""toolkit/train/checkpoint/reshard.py without a launch: the pieces the 4-rank resharding test (test_train_reshard.py) cannot
single out. Adam's state is created without moving a weight, the step count is found and set where each Adam
keeps it (per parameter in torch / DeepSpeed's CPU Adam, per group in FusedAdam, the GPU default), shape
mismatches are listed, and a plain HF model at another layout is refused by name."""

import types

import pytest
import torch

from toolkit import backend
from toolkit.errors import DsmtError
from toolkit.launch.local import single_process_group
from toolkit.train.checkpoint import checkpoints, reshard
from test_train_checkpoints import FakeEngine

LAYOUT_A = {"tp": 2, "pp": 2, "vpp": 1, "cp": 1, "dp": 1, "ep": 1, "zero_stage": 1, "world_size": 4}
LAYOUT_B = {**LAYOUT_A, "tp": 1, "pp": 1, "dp": 4}


def test_materialized_adam_state_moves_no_weight():
    weights = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    before = [w.detach().clone() for w in weights]
    adam = torch.optim.AdamW([{"params": weights[:1], "weight_decay": 0.1}, {"params": weights[1:], "weight_decay": 0.0}],
                             lr=1e-2)
    engine = types.SimpleNamespace(optimizer=adam)  # ZeRO-0 in fp32: no DeepSpeed wrapper
    reshard.materialize_optimizer_state(engine, adam)
    assert all(torch.equal(w, b) for w, b in zip(weights, before))
    assert all(set(reshard.MOMENTS) <= set(adam.state[w]) for w in weights)
    assert [g["lr"] for g in adam.param_groups] == [1e-2, 1e-2] and all(w.grad is None for w in weights)
    reshard.set_optimizer_step(adam, 7)
    assert reshard.optimizer_step(adam) == 7 and all(adam.state[w]["step"].item() == 7 for w in weights)


def test_group_step_of_fused_adam_is_found_and_set():
    fused_like = types.SimpleNamespace(state={}, param_groups=[{"params": [], "step": 3}, {"params": [], "step": 3}])
    assert reshard.optimizer_step(fused_like) == 3
    reshard.set_optimizer_step(fused_like, 9)
    assert [g["step"] for g in fused_like.param_groups] == [9, 9]


def test_shape_problems_list_every_difference():
    saved = {"a": [4, 8], "b": [[2, 3], [2, 3]], "gone": [1]}
    current = {"a": [4, 8], "b": [[2, 5], [2, 5]], "new": [2]}
    problems = reshard.shape_problems(saved=saved, current=current)
    assert problems == ["gone: this run has no such parameter (checkpoint shape [1])",
                        "new: not in the checkpoint (this run's shape [2])",
                        "b: checkpoint shape [[2, 3], [2, 3]], this run's [[2, 5], [2, 5]]"]


def test_plain_model_at_another_layout_is_refused(tmp_path):
    from toolkit.parallel.groups import Layout, init_process_groups

    with single_process_group(dist_backend=backend.current().dist_backend):
        init_process_groups(layout=Layout(), dist_backend=backend.current().dist_backend)
        checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=2, layout=LAYOUT_A)
        assert checkpoints.resume(engine=FakeEngine(), checkpoint_dir=tmp_path, layout=LAYOUT_A).step == 2
        with pytest.raises(DsmtError, match=r"written at tp=2 pp=2 .* this run is tp=1 pp=1 .*plain HF model"):
            checkpoints.resume(engine=FakeEngine(), checkpoint_dir=tmp_path, layout=LAYOUT_B)


def test_a_checkpoint_without_layout_free_state_is_named(tmp_path):
    (tmp_path / "step_000004").mkdir()
    state = reshard.LayoutFreeState(engine=None, chunks=[], layout=LAYOUT_B, global_batch_size=8)
    with pytest.raises(DsmtError, match=r"step_000004 has no layout-free state .* resumes only at the layout"):
        state.check(tmp_path / "step_000004")
