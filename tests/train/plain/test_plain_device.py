"""Plain HF models (DeepSpeed ZeRO only) keep every tensor they feed the model or a collective on the engine's
device. On a GPU node that is cuda:LOCAL_RANK and the process group is NCCL, which all-reduces only CUDA tensors;
DeepSpeed's forward moves nothing. Here the fake engine's device is `meta` (a device that is not the CPU and needs
no GPU), so a batch or a counter left on the CPU shows as a CPU tensor where a meta one was expected."""

import pytest
import torch
import torch.distributed as dist

from toolkit.train.plain.engine import PlainEngine

DEVICE = torch.device("meta")
VOCAB = 11


class FakeEngine:
    """The parts of a DeepSpeed engine PlainEngine uses; records the device of every input it is given."""

    device = DEVICE
    training = True

    def __init__(self):
        self.module = torch.nn.Linear(2, 2)  # parameters give the dtype (fp32)
        self.input_devices = []

    def __call__(self, **inputs):
        self.input_devices += [v.device for v in inputs.values()]
        ids = inputs["input_ids"]
        logits = torch.zeros(*ids.shape, VOCAB, device=ids.device, requires_grad=True)
        return type("Out", (), {"logits": logits, "loss": logits.sum()})()

    def backward(self, loss, **kwargs):
        pass

    def step(self):
        pass

    def eval(self):
        pass

    def train(self, mode=True):
        pass


@pytest.fixture
def engine(monkeypatch):
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **kw: reduced.append(tensor.device))
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **kw: 2)
    plain_engine = object.__new__(PlainEngine)
    plain_engine._engine = FakeEngine()
    plain_engine.task = "causal_lm"
    plain_engine.vocab_size = VOCAB
    return plain_engine, reduced


def cpu_batches(count=2):
    ids = torch.arange(8).reshape(2, 4) % VOCAB
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()} for _ in range(count)]


def test_training_step_moves_each_micro_batch_to_the_engines_device(engine, monkeypatch):
    plain_engine, _ = engine
    seen = []

    def token_loss_steps(batches):
        seen.extend(v.device for batch in batches for v in batch.values())
        return torch.zeros(1)

    monkeypatch.setattr(plain_engine, "_token_loss_steps", token_loss_steps)
    monkeypatch.setattr(plain_engine._engine, "optimizer", type("O", (), {"param_groups": [{"lr": 0.1}]})(),
                        raising=False)
    monkeypatch.setattr(plain_engine._engine, "get_global_grad_norm", lambda: None, raising=False)
    plain_engine.train_step(cpu_batches())
    assert seen and set(seen) == {DEVICE}


def test_token_loss_counts_and_reduces_on_the_engines_device(engine):
    plain_engine, reduced = engine
    total = plain_engine._token_loss_steps([plain_engine._on_device(b) for b in cpu_batches()])
    assert reduced == [DEVICE]  # num_items, the global label count
    assert total.device == DEVICE
    assert set(plain_engine._engine.input_devices) == {DEVICE}


def test_mean_loss_stays_on_the_engines_device(engine):
    plain_engine, _ = engine
    plain_engine.task = "image_classification"
    loss = plain_engine._mean_loss_steps([plain_engine._on_device(b) for b in cpu_batches()])
    assert loss.device == DEVICE


def test_validation_sums_are_reduced_on_the_engines_device(engine, monkeypatch):
    plain_engine, reduced = engine
    monkeypatch.setattr(plain_engine, "_loss_sum", lambda logits, batch: (torch.tensor(1.0), torch.tensor(3)))
    with pytest.raises(NotImplementedError, match="meta"):  # reading the reduced sums back: meta holds no data
        plain_engine.eval_step(cpu_batches(1))
    assert reduced == [DEVICE]
    assert set(plain_engine._engine.input_devices) == {DEVICE}
