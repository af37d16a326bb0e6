"""What the hybrid engine does with one micro-batch, per training task: the model call, the loss SUM over the
micro-batch, and the number of loss units that sum is over. The engine (toolkit/train/engine/hybrid.py) divides every
sum by the units of the whole GLOBAL batch, in both of its drivers, so that

  causal_lm                loss per counted token over the global batch (HF's `num_items_in_batch`);
  masked_lm                loss per masked token (label != -100) over the global batch;
  sequence_classification  loss per sample over the global batch: mean squared error when num_labels == 1
                           (regression, HF's MSELoss), cross entropy otherwise (HF's CrossEntropyLoss).

Batches: causal LM reads dsmt's token rows (`tokens`, `position_ids`, `labels`, `loss_mask`,
toolkit/data/batches.py), whose position ids restart at each packed record (toolkit/adapters/packed.py); the
encoder tasks read HF keyword inputs (`input_ids`, `attention_mask`, `token_type_ids`, `labels`,
toolkit/data/tasks.py). The task comes from the HF architecture (`task_for_model`).
"""

from __future__ import annotations

import dataclasses

import torch

from toolkit.errors import DsmtError
from toolkit.train.engine.loss import masked_token_loss_sum

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
        """Packed records (position ids restarting inside a row, toolkit/adapters/packed.py) attend only to
        themselves: a block-diagonal causal mask on megatron's local attention, THD `PackedSeqParams` on Transformer
        Engine's. Rows of one record each take megatron's plain causal path. Which one, and THD's record
        boundaries, come from the batch's host-read facts (toolkit/train/engine/step_inputs.py); a batch without
        them (a caller of its own) is read here."""
        from toolkit.adapters import packed
        from toolkit.train.engine.step_inputs import batch_facts, facts_of

        tokens, position_ids = batch["tokens"], batch["position_ids"]
        facts = facts_of(batch) or batch_facts(batch)
        if not facts.packed:
            return model(tokens, position_ids, None)
        check_packing_layout()
        if not packed.uses_thd(model):
            with packed.longest_record(model, facts.max_seqlen):  # RoPE's table length (Phi-3: its factors)
                return model(tokens, position_ids, packed.packed_attention_mask(position_ids))
        params = packed.thd_packed_seq_params(cu_seqlens=facts.cu_seqlens.to(tokens.device),
                                              max_seqlen=facts.max_seqlen)
        return thd_forward(model, tokens=tokens, position_ids=position_ids, params=params)

    def loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        return masked_token_loss_sum(output, labels=batch["labels"], loss_mask=batch["loss_mask"])


def check_packing_layout() -> None:
    """Packed records are not cut for context parallelism (megatron's CP slicing of THD needs padded cu_seqlens,
    and the local attention has no CP). `dsmt check` says so first (rule packing_context_parallel)."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1:
        raise DsmtError(f"data.packing=true with parallel.cp={cp_size}: packed records are not supported under "
                        "context parallelism; set data.packing: false (one record per row) or parallel.cp: 1")


def thd_forward(model, *, tokens: torch.Tensor, position_ids: torch.Tensor, params) -> torch.Tensor:
    """TE attention on packed rows: the micro-batch [b, s] as one THD row [1, b*s] (megatron expects micro-batch 1
    for THD) with cu_seqlens at every record; the logits come back as [b, s, vocab/tp], so labels and loss mask
    stay as they are. Inner pipeline stages return hidden states, sent on unchanged."""
    from megatron.core import parallel_state

    rows, length = tokens.shape
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if rows > 1 and pp_size > 1:  # `dsmt check` says so first (rule packing_fused_micro_batch)
        raise DsmtError(f"data.packing=true with training.attention=fused, pp={pp_size} and micro_batch_size={rows}: "
                        "Transformer Engine takes packed records as one THD row per micro-batch, and the pipeline's "
                        "activation shapes are micro_batch_size x seq_length; set training.micro_batch_size: 1 "
                        "(raise gradient accumulation instead), or data.packing: false")
    output = model(tokens.reshape(1, rows * length), position_ids.reshape(1, rows * length), None,
                   packed_seq_params=params)
    is_logits = output.dim() == 3 and output.shape[0] == 1 and output.shape[1] == rows * length
    return output.reshape(rows, length, output.shape[-1]) if is_logits and rows > 1 else output


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
        return masked_token_loss_sum(output, labels=batch["labels"].clamp(min=0), loss_mask=counted)


@dataclasses.dataclass(frozen=True)
class SequenceClassification(EncoderInputs):
    """An encoder's pooled classifier output [b, num_labels], replicated over TP: squared error summed over the
    samples (num_labels == 1) or cross entropy summed over the samples."""

    num_labels: int
    name = "sequence_classification"

    def count(self, batch: dict) -> int:
        mask = batch.get("sample_mask")  # validation: 0 on padding rows (toolkit/train/job/evaluate.py)
        return int(batch["labels"].shape[0] if mask is None else mask.sum().item())

    def loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        output = output.float()
        mask = batch.get("sample_mask")
        if self.num_labels == 1:
            losses = (output.view(-1) - batch["labels"].float().view(-1)).pow(2)
        else:
            losses = torch.nn.functional.cross_entropy(output.view(-1, self.num_labels), batch["labels"].view(-1),
                                                       reduction="none")
        return losses.sum() if mask is None else (losses * mask.to(losses.dtype)).sum()


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
