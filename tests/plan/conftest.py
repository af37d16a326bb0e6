"""Live measurements shared by test_live_engine.py and test_measured.py: each launch runs once per session
(tests/plan/live_memory.py; imports cost ~6 s per process, so every case of a launch shares its processes)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def live_model(tmp_path_factory):
    """The tiny GQA Llama (hidden 64, 4 layers, 8 heads / 2 KV heads, vocab 250 padded to 256)."""
    from toolkit.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("live-memory") / "llama")


def _launch(index: int, model_dir, tmp_path_factory) -> list[dict]:
    from live_memory import LAUNCHES, run_launch

    processes, cases = LAUNCHES[index]
    return run_launch(model_dir=model_dir, out_dir=tmp_path_factory.mktemp(f"live-launch{index}"),
                      processes=processes, cases=cases)


@pytest.fixture(scope="session")
def live_two_ranks(live_model, tmp_path_factory) -> list[dict]:
    """Per-rank results of the 2-process launch: model states at tp1/dp2, tp2/dp1, tp1/pp2, and activations."""
    return _launch(0, live_model, tmp_path_factory)


@pytest.fixture(scope="session")
def live_four_ranks(live_model, tmp_path_factory) -> list[dict]:
    """Per-rank results of the 4-process launch: model states at tp2/pp2 and dp4."""
    return _launch(1, live_model, tmp_path_factory)
