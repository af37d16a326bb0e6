"""checkpoints.py without a model: RNG states saved and restored (the next draws repeat), and
`training.keep_checkpoints` pruning of old complete tags. A fake engine stands in for DeepSpeed's."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit import backend
from train_helpers import FakeEngine
from toolkit.errors import DsmtError
from toolkit.launch.local import single_process_group
from toolkit.train.checkpoint import checkpoints
from toolkit.train.checkpoint.checkpoints import COMPLETE_MARKER, LATEST, latest_complete, prune


@pytest.fixture
def process_group():
    from toolkit.parallel.groups import Layout, init_process_groups

    with single_process_group(dist_backend=backend.current().dist_backend):
        init_process_groups(layout=Layout(), dist_backend=backend.current().dist_backend)
        backend.current().seed(11)
        yield


def _draws(device="cpu"):
    return (torch.rand(4, device=device).tolist(), torch.randint(0, 1000, (3,)).tolist(), random.random(),
            np.random.rand(2).tolist())


def test_resume_repeats_the_draws_after_the_save(process_group, tmp_path):
    torch.rand(7), random.random(), np.random.rand()  # move every generator off its seed
    checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=3)
    after_save = _draws()
    torch.manual_seed(999), random.seed(999), np.random.seed(999)
    assert checkpoints.resume(engine=FakeEngine(), checkpoint_dir=tmp_path).step == 3
    assert _draws() == after_save
    saved = torch.load(tmp_path / "step_000003" / "dsmt_rng_rank0.pt")
    assert set(saved) == {"torch", "cuda", "megatron_tracker", "python", "numpy"}
    if not torch.cuda.is_available():  # the CPU backend seeds megatron's inference tracker: nothing to save
        assert saved["cuda"] is None and saved["megatron_tracker"] == {}


def test_megatron_tracker_streams_are_restored(process_group, tmp_path):
    """The training-flavour tracker (what CUDA runs use): the stream dropout forks into comes back. On the CPU
    the backend points megatron's generator helpers at torch's CPU generator, so the same code runs here."""
    from megatron.core.tensor_parallel import random as megatron_random

    device = "cuda" if torch.cuda.is_available() else "cpu"
    get_state = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    megatron_random.initialize_rng_tracker(force_reset=True)
    try:
        tracker = megatron_random.get_cuda_rng_tracker()
        torch.manual_seed(21)
        tracker.set_states({"model-parallel-rng": get_state()})
        torch.manual_seed(5)
        with tracker.fork():
            torch.rand(3, device=device)
        checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=1)
        with tracker.fork():
            forked = torch.rand(5, device=device)
        tracker.set_states({"model-parallel-rng": get_state()})  # a different stream
        checkpoints.resume(engine=FakeEngine(), checkpoint_dir=tmp_path)
        with tracker.fork():
            assert torch.equal(torch.rand(5, device=device), forked)
    finally:  # leave the flavour dsmt's backend uses, for the tests that follow in this process
        megatron_random.initialize_rng_tracker(force_reset=True, inference_rng_tracker=device == "cpu")


def _fake_tags(root: Path, *, complete, incomplete=(), latest=None):
    for step in complete:
        (root / checkpoints.tag_for(step)).mkdir(parents=True)
        (root / checkpoints.tag_for(step) / COMPLETE_MARKER).write_text("{}")
    for step in incomplete:
        (root / checkpoints.tag_for(step)).mkdir(parents=True)
    if latest is not None:
        (root / LATEST).write_text(checkpoints.tag_for(latest))


def _left(root: Path):
    from toolkit.train.checkpoint.folders import wait_for_removals

    wait_for_removals()  # old tags are deleted by a thread (renamed out of the way first)
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_prune_keeps_the_newest_complete_and_every_incomplete_tag(tmp_path):
    _fake_tags(tmp_path, complete=(5, 10, 15, 20), incomplete=(3, 25), latest=20)
    assert prune(tmp_path, keep=2) == ["step_000005", "step_000010"]
    assert _left(tmp_path) == ["step_000003", "step_000015", "step_000020", "step_000025"]
    assert prune(tmp_path, keep=2) == []


def test_prune_never_deletes_the_latest_pointer_target(tmp_path):
    _fake_tags(tmp_path, complete=(5, 10, 15), latest=5)  # a pointer left behind (it is replaced after each save)
    prune(tmp_path, keep=1)
    assert _left(tmp_path) == ["step_000005", "step_000015"]


def test_prune_orders_by_step_number_not_by_name(tmp_path):
    _fake_tags(tmp_path, complete=(999_999, 1_000_000), latest=1_000_000)
    prune(tmp_path, keep=1)
    assert _left(tmp_path) == ["step_1000000"]


def test_prune_refuses_keep_below_one(tmp_path):
    with pytest.raises(DsmtError, match="keep_checkpoints=0 must be >= 1"):
        prune(tmp_path, keep=0)


def test_save_with_keep_checkpoints_prunes_after_marking(process_group, tmp_path):
    for step in (1, 2, 3, 4):
        checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=step, keep_checkpoints=2)
    assert _left(tmp_path) == ["step_000003", "step_000004"]
    assert latest_complete(tmp_path) == "step_000004"
    checkpoints.save(engine=FakeEngine(), checkpoint_dir=tmp_path, step=5)  # None keeps every one
    assert _left(tmp_path) == ["step_000003", "step_000004", "step_000005"]


def test_keep_checkpoints_is_validated_by_the_schema():
    from pydantic import ValidationError

    from toolkit.spec.schema import TrainingSpec

    assert TrainingSpec().keep_checkpoints == 2 and TrainingSpec(keep_checkpoints=1).keep_checkpoints == 1
    assert TrainingSpec(keep_checkpoints=None).keep_checkpoints is None  # keep every one, when asked
    with pytest.raises(ValidationError, match="keep_checkpoints"):
        TrainingSpec(keep_checkpoints=0)
