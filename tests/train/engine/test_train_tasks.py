"""The engine's tasks alone (toolkit/train/engine/tasks.py): each loss sum over its count is HF's loss on the same outputs."""

import pytest
import torch

from toolkit.train.engine.tasks import CausalLM, MaskedLM, SequenceClassification, task_for_model


def test_regression_and_classification_equal_hf_losses():
    generator = torch.Generator().manual_seed(0)
    outputs = torch.randn(5, 1, generator=generator)
    batch = {"input_ids": torch.zeros(5, 8, dtype=torch.long), "labels": torch.randn(5, generator=generator)}
    regression = SequenceClassification(num_labels=1)
    assert regression.count(batch) == 5
    hf_mse = torch.nn.MSELoss()(outputs.squeeze(), batch["labels"].squeeze())
    assert torch.allclose(regression.loss_sum(outputs, batch) / regression.count(batch), hf_mse)
    logits, classes = torch.randn(5, 3, generator=generator), torch.tensor([0, 2, 1, 1, 0])
    hf_ce = torch.nn.CrossEntropyLoss()(logits, classes)
    three = SequenceClassification(num_labels=3)
    assert torch.allclose(three.loss_sum(logits, {"labels": classes}) / 5, hf_ce)


def test_masked_lm_counts_masked_tokens_and_ignores_the_padded_vocabulary():
    """Logits over the padded vocabulary (250 -> 256): the 6 extra columns take no part, as HF has none (the MLM
    head's output layer sets them to -inf: toolkit/adapters/vocab_mask.py)."""
    from megatron.core import parallel_state

    from toolkit.adapters.vocab_mask import PaddedVocabMask
    from toolkit.launch.local import single_process_group

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 256, generator=generator)
    logits[..., 250:] = 30.0  # would dominate the softmax if they were counted
    labels = torch.full((2, 6), -100)
    labels[0, 1], labels[1, 4], labels[1, 5] = 7, 249, 0
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "labels": labels}
    task = MaskedLM(vocab_size=250)
    # the loss consumes fp32 logits (megatron's cross entropy turns them into the softmax in place): HF's first
    hf = torch.nn.functional.cross_entropy(logits[..., :250].flatten(0, 1), labels.flatten(), ignore_index=-100)
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        PaddedVocabMask(vocab_size=250, padded_vocab_size=256)(None, None, (logits, None))
        summed = task.loss_sum(logits, batch)
    assert task.count(batch) == 3 and torch.allclose(summed / 3, hf)


def test_task_follows_the_head():
    from transformers import BertConfig

    from toolkit.adapters.hf_config import model_settings
    from toolkit.models.tiny import tiny_config
    from toolkit.demo.tiny_encoder import TINY_BERT

    assert task_for_model(settings=model_settings(tiny_config("llama"))) == CausalLM(vocab_size=250)
    mlm = model_settings(BertConfig(**TINY_BERT, architectures=["BertForMaskedLM"]))
    assert task_for_model(settings=mlm) == MaskedLM(vocab_size=250)
    regression = model_settings(BertConfig(**TINY_BERT, architectures=["BertForSequenceClassification"], num_labels=1))
    assert task_for_model(settings=regression) == SequenceClassification(num_labels=1)


@pytest.mark.parametrize("task,batch,units", [
    (CausalLM(vocab_size=250), {"tokens": torch.zeros(2, 4, dtype=torch.long),
                                "loss_mask": torch.tensor([[1, 1, 0, 1], [0, 0, 0, 1]])}, 4),
    (MaskedLM(vocab_size=250), {"input_ids": torch.zeros(2, 4, dtype=torch.long),
                                "labels": torch.tensor([[-100, 5, -100, 3], [-100, -100, 1, -100]])}, 3),
    (SequenceClassification(num_labels=1), {"input_ids": torch.zeros(2, 4, dtype=torch.long),
                                            "labels": torch.tensor([0.5, 1.5])}, 2),
])
def test_counts_are_the_loss_units(task, batch, units):
    assert task.count(batch) == units and task.sequence(batch).shape == (2, 4)
