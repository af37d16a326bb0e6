"""Regression labels (num_labels == 1, float targets) reach the loss as fp32 in training and in validation alike
(toolkit/train/plain/engine.py `_on_device`): a bf16 model's training loss (HF's MSELoss inside the model) and its
validation loss (dsmt's squared error) of the same rows are the same number. Targets cast to bf16 in one path only
(4.1 -> 4.09375) would make them differ by ~1e-3 of the loss. In-process: DeepSpeed's engine is a stand-in."""

import pytest
import torch
import torch.distributed as dist

from toolkit.train.plain.engine import PlainEngine

TARGETS = torch.tensor([0.1234, 3.3333, -2.0101, 4.1])  # none of them a bf16 number


class Engine:
    """The parts of a DeepSpeed engine PlainEngine uses, around a bf16 HF regression model on the CPU."""

    device = torch.device("cpu")

    def __init__(self, module):
        self.module, self.training, self.labels_seen = module, True, []
        self.optimizer = type("Optimizer", (), {"param_groups": [{"lr": 0.1}]})()

    def __call__(self, **inputs):
        if "labels" in inputs:
            self.labels_seen.append(inputs["labels"].dtype)
        return self.module(**inputs)

    def backward(self, loss, **kwargs):
        pass

    def step(self):
        pass

    def get_global_grad_norm(self):
        return None

    def eval(self):
        self.training = False
        self.module.eval()

    def train(self, mode=True):
        self.training = mode
        self.module.train(mode)


@pytest.fixture
def engine(monkeypatch):
    import transformers

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **kw: None)  # one rank
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **kw: 1)
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(vocab_size=30, dim=16, n_layers=1, n_heads=2, hidden_dim=32, num_labels=1,
                                           max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                           seq_classif_dropout=0.0)  # train and eval forwards alike
    model = transformers.DistilBertForSequenceClassification(config).to(torch.bfloat16)
    plain = object.__new__(PlainEngine)
    plain._engine, plain.task, plain.vocab_size = Engine(model), "sequence_classification", None
    return plain


def test_training_and_validation_take_the_same_fp32_regression_loss(engine):
    ids = torch.arange(24).reshape(4, 6) % 30
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": TARGETS.clone()}
    trained = engine.train_step([dict(batch)]).loss  # HF's MSELoss, the mean over the 4 rows
    sums = engine.eval_step([{**batch, "sample_mask": torch.ones(4)}])
    assert engine._engine.labels_seen == [torch.float32]  # training handed the model fp32 targets
    assert sums.units == 4
    assert trained == pytest.approx(sums.loss_sum / sums.units, rel=1e-6)
    with torch.no_grad():  # and both are the fp32 squared error against the targets as given
        logits = engine._engine.module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    assert trained == pytest.approx((logits.view(-1) - TARGETS).pow(2).mean().item(), rel=1e-6)
