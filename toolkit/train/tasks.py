"""What the hybrid engine does with one micro-batch, per training task: the model call, the loss SUM over the
micro-batch, and the number of loss units that sum is over. The engine (toolkit/train/engine.py) divides every
sum by the units of the whole GLOBAL batch, in both of its drivers, so that

  causal_lm                loss per counted token over the global batch (HF's `num_items_in_batch`);
  masked_lm                loss per masked token (label != -100) over the global batch;
  sequence_classification  loss per sample over the global batch: mean squared error when num_labels == 1
                           (regression, HF's MSELoss), cross entropy otherwise (HF's CrossEntropyLoss).

Batches: causal LM reads dsmt's token windows (`tokens`, `position_ids`, `labels`, `loss_mask`,
toolkit/data/batches.py); the encoder tasks read HF keyword inputs (`input_ids`, `attention_mask`,
`token_type_ids`, `labels`, toolkit/data/tasks.py). The task comes from the HF architecture (`task_for_model`).
"""

from __future__ import annotations

import dataclasses

import torch

from toolkit.errors import DsmtError
from toolkit.train.loss import masked_token_loss_sum

IGNORE_INDEX = -100  # HF's label for tokens without loss


@dataclasses.dataclass(frozen=True)
class CausalLM:
    """megatron GPTModel: next-token cross entropy on the vocab-parallel logits, padded vocabulary excluded."""

    vocab_size: int
    name = "causal_lm"

    def sequence(self, batch: dict) -> torch.Tensor:
        return batch["tokens"]

    def count(self, batch: dict) -> int:
        return int(batch["loss_mask"].sum().item())

    def forward(self, model, batch: dict) -> torch.Tensor:
        return model(batch["tokens"], batch["position_ids"], None)

    def loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        return masked_token_loss_sum(output, labels=batch["labels"], loss_mask=batch["loss_mask"],
                                     vocab_size=self.vocab_size)


class EncoderInputs:
    """The encoder models' call (toolkit/adapters/encoder.py) on HF keyword batches."""

    def sequence(self, batch: dict) -> torch.Tensor:
        return batch["input_ids"]

    def forward(self, model, batch: dict) -> torch.Tensor:
        return model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))


@dataclasses.dataclass(frozen=True)
class MaskedLM(EncoderInputs):
    """An encoder's MLM head: cross entropy of the tokens whose label is not -100 (HF's collator masks)."""

    vocab_size: int
    name = "masked_lm"

    def count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum().item())

    def loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        counted = batch["labels"] != IGNORE_INDEX
        # -100 is no vocabulary index: those tokens take label 0 and weight 0
        return masked_token_loss_sum(output, labels=batch["labels"].clamp(min=0), loss_mask=counted,
                                     vocab_size=self.vocab_size)


@dataclasses.dataclass(frozen=True)
class SequenceClassification(EncoderInputs):
    """An encoder's pooled classifier output [b, num_labels], replicated over TP: squared error summed over the
    samples (num_labels == 1) or cross entropy summed over the samples."""

    num_labels: int
    name = "sequence_classification"

    def count(self, batch: dict) -> int:
        return int(batch["labels"].shape[0])

    def loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        output = output.float()
        if self.num_labels == 1:
            return (output.view(-1) - batch["labels"].float().view(-1)).pow(2).sum()
        return torch.nn.functional.cross_entropy(output.view(-1, self.num_labels), batch["labels"].view(-1),
                                                 reduction="sum")


def task_for_model(*, settings) -> CausalLM | MaskedLM | SequenceClassification:
    """The training task of a model the adapters built (`ModelSettings`): its encoder head, else causal LM."""
    encoder = settings.encoder
    if encoder is None:
        return CausalLM(vocab_size=settings.vocab_size)
    if encoder.task == "masked_lm":
        return MaskedLM(vocab_size=settings.vocab_size)
    if encoder.task == "sequence_classification":
        return SequenceClassification(num_labels=encoder.num_labels)
    raise DsmtError(f"encoder head {encoder.task!r} has no training task; supported: masked_lm, "
                    "sequence_classification")
