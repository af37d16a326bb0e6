"""Every trainer answers the `Trainer` protocol (toolkit/train/engine/trainer.py) that the training loop asks of it:
the megatron-core engine, the plain HF engine and a script's `TrainingRun`. Signatures only: nothing is built."""

import inspect

import pytest

from toolkit.train.engine.hybrid import HybridEngine
from toolkit.train.engine.trainer import Trainer
from toolkit.train.job.session import TrainingRun
from toolkit.train.plain.engine import PlainEngine

METHODS = ("train_step", "eval_step", "save", "load")


def protocol_gaps(cls) -> list[str]:
    """What `cls` lacks of `Trainer`: a method, a parameter the protocol passes (same name, same kind), a
    parameter of its own the protocol's callers would not pass (one without a default), or the `engine`."""
    gaps = []
    for name in METHODS:
        method = getattr(cls, name, None)
        if not callable(method):
            gaps.append(f"{name}: missing")
            continue
        wanted = list(inspect.signature(getattr(Trainer, name)).parameters.values())[1:]
        given = dict(list(inspect.signature(method).parameters.items())[1:])
        for param in wanted:
            mine = given.pop(param.name, None)
            if mine is None or mine.kind != param.kind:
                gaps.append(f"{name}: no {param.kind.description} parameter {param.name!r}")
            elif param.default is not inspect.Parameter.empty and mine.default is inspect.Parameter.empty:
                gaps.append(f"{name}: {param.name!r} has no default")
        gaps += [f"{name}: {extra.name!r} is required" for extra in given.values()
                 if extra.default is inspect.Parameter.empty
                 and extra.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    declared = any("engine" in vars(klass).get("__annotations__", {}) for klass in cls.__mro__)
    if not (isinstance(inspect.getattr_static(cls, "engine", None), property) or declared):
        gaps.append("engine: neither a property nor a declared attribute")
    return gaps


@pytest.mark.parametrize("trainer_class", [HybridEngine, PlainEngine, TrainingRun])
def test_every_trainer_answers_the_protocol(trainer_class):
    assert protocol_gaps(trainer_class) == []


def test_a_trainer_that_falls_short_is_named_by_what_it_lacks():
    class Partial:
        engine = None

        def train_step(self, micro_batches):
            return None

        def save(self, checkpoint_dir, *, step, keep_checkpoints=None, layout, background=False, also_write=None):
            return checkpoint_dir  # layout: no default

        def load(self, checkpoint_dir, layout=None, *, fallback=True, owner=False, strict):
            return None

    assert protocol_gaps(Partial) == [
        "eval_step: missing",
        "save: 'layout' has no default",
        "load: no keyword-only parameter 'layout'",
        "load: 'strict' is required",
        "engine: neither a property nor a declared attribute",
    ]
