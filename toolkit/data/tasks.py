"""Training data for HF task heads: masked LM, sequence classification / regression, image classification and
causal LM, as the keyword inputs of the HF model (`input_ids`, `attention_mask`, `token_type_ids`, `labels`;
`pixel_values`, `labels`).

The task comes from the class named in `config.architectures[0]` (`TASK_SUFFIXES`). Records are read with
`toolkit.data.sources.load_records` (images: `toolkit.data.images`). Text tasks hold one example per record,
tokenised with the checkpoint's tokenizer, truncated at `seq_length` and padded to it with the tokenizer's pad
token (`attention_mask` 0 there); causal LM reuses the token-stream rules of `toolkit.data.tokenize` (packed text,
prompt/completion, chat) with windows of `seq_length` tokens, `labels` -100 where no loss counts.

Sample order (`TaskBatches`) is the rule of `toolkit/data/batches.py`: global position `g = step*G + j`, example
`randperm(N, seed + g // N)[g % N]`, `j = (m*dp + r)*micro + i` for row `i` of micro-batch `m` on rank `r`.

Masked-LM masking is `transformers.DataCollatorForLanguageModeling.torch_mask_tokens` (mlm_probability 0.15, 80%
mask token, 10% random token, 10% unchanged), applied to ONE row at a time, as a `[1, seq_length]` batch, with the
collator's generator set to `torch.Generator().manual_seed(seed * 2**32 + g)` (`mlm_row_seed`), `g` the row's global
sample position. From that generator, in this order: (1) `bernoulli` of 0.15 at tokens that are neither special
(the tokenizer's special-tokens mask) nor padding, 0 elsewhere: the selected tokens; `labels` are the original ids
there, -100 elsewhere; (2) `bernoulli(0.8)` over the row: selected ones become the mask token; (3) `bernoulli(0.5)`
over the row: selected, not yet replaced ones become (4) `randint(len(tokenizer))` drawn over the row; the rest stay
unchanged. So the masks are a pure function of (seed, g): the same whatever the DP split, reproducible by an
independent reference, and different in each epoch (g grows).

Validation (`data.validation_path` / `validation_fraction`, toolkit/data/validation.py): `task_examples(part=...)`
reads the records of one side (`validation.part_records`: the held-out share is left out of training; images: the
validation folder, or the same `split_records` share of the sorted images) by the same rules. Validation row `v`
(its index in the validation records) is masked as above with g = v: `mlm_row_seed(seed, v)`, the same masks
whatever the layout or micro-batch size (toolkit/train/job/evaluate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.data.batches import MicroBatches
from toolkit.data.labels import LabelFieldMissingError, LabelTypeError, TaskExamples, check_num_labels, named_labels
from toolkit.errors import DsmtError

# Task, by the suffix of the HF class name in config.architectures[0].
TASK_SUFFIXES = {
    "masked_lm": ("ForMaskedLM",),
    "sequence_classification": ("ForSequenceClassification",),
    "image_classification": ("ForImageClassification",),
    "causal_lm": ("ForCausalLM", "LMHeadModel"),
}
MLM_PROBABILITY = 0.15  # BERT's masking rate, HF's collator default (with its 80/10/10 split)


class UnsupportedTaskError(DsmtError):
    """config.architectures[0] names a head dsmt cannot make batches for."""

    rule = "plain_model_task"  # the `dsmt check` rule name


def task_of(model_config) -> str:
    """The task of the model, from the class named in `model_config.architectures[0]`."""
    architectures = getattr(model_config, "architectures", None) or []
    for task, suffixes in TASK_SUFFIXES.items():
        if architectures and architectures[0].endswith(suffixes):
            return task
    supported = "; ".join(f"{task} (*{', *'.join(suffixes)})" for task, suffixes in TASK_SUFFIXES.items())
    raise UnsupportedTaskError(
        f"architectures={architectures} (model_type {getattr(model_config, 'model_type', None)!r}): dsmt cannot map "
        f"this head to a training task; supported class-name suffixes: {supported}; save the model with one of "
        f"these heads (e.g. AutoModelForSequenceClassification) so config.json's architectures names it")


def mlm_row_seed(*, seed: int, position: int) -> int:
    """The generator seed of the masks of the row at global sample position `position` (module docstring)."""
    return seed * 2**32 + position


@dataclass
class TextExamples(TaskExamples):
    """Tokenised text examples `[N, seq_length]`; `labels` per example for classification, per token for causal
    LM, None for masked LM (masked per batch: `mlm_row_seed`)."""

    task: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    special_tokens_mask: torch.Tensor | None = None  # masked LM: 1 where a token is never masked
    collator: object | None = None  # masked LM: the HF DataCollatorForLanguageModeling
    seed: int = 0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def batch(self, *, indices: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids[indices], "attention_mask": self.attention_mask[indices]}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids[indices]
        if self.task == "masked_lm":
            out["input_ids"], out["labels"] = self._mask(out["input_ids"], indices=indices, positions=positions)
        else:
            out["labels"] = self.labels[indices]
        return out

    def _mask(self, input_ids: torch.Tensor, *, indices: torch.Tensor, positions: torch.Tensor):
        rows, labels = [], []
        for row, index, position in zip(input_ids, indices.tolist(), positions.tolist()):
            self.collator.generator = torch.Generator().manual_seed(mlm_row_seed(seed=self.seed, position=position))
            masked, row_labels = self.collator.torch_mask_tokens(
                row[None].clone(), special_tokens_mask=self.special_tokens_mask[index][None])
            rows.append(masked[0])
            labels.append(row_labels[0])
        return torch.stack(rows), torch.stack(labels)


def task_examples(*, data, model_config, tokenizer_path: str, seq_length: int, seed: int,
                  cache_dir: str | None = None, part: str = "train") -> TaskExamples:
    """The examples of `data` (a `DataSpec` with `path` set) for the task of `model_config`; see the module
    docstring. `tokenizer_path`: the checkpoint directory (its tokenizer, or its image processor for images;
    `data.tokenizer` wins for text). `cache_dir`: the `datasets` cache (None: its default). `part`: "train" (all
    of data.path but a held-out `validation_fraction`) or "validation" (toolkit/data/validation.py)."""
    from toolkit.data.validation import VALIDATION, part_records, validation_spec

    task = task_of(model_config)
    if data.path is None:
        raise DsmtError(f"data.path is unset: task {task} needs records to train on; set data.path, or "
                        f"data.synthetic: true for synthetic inputs")
    if task == "image_classification":
        examples = _image_part(data=data, part=part, model_config=model_config, processor_path=tokenizer_path,
                               seed=seed, cache_dir=cache_dir)
        _print_on_rank0(examples.description)
        return examples
    from toolkit.data.tokenize import load_tokenizer

    tokenizer = load_tokenizer(data=data, model_path=tokenizer_path)
    if task == "causal_lm":
        return _causal_examples(data=data, tokenizer=tokenizer, seq_length=seq_length, cache_dir=cache_dir,
                                part=part, seed=seed)
    records = part_records(data=data, part=part, seed=seed, cache_dir=cache_dir)
    source = validation_spec(data) if part == VALIDATION and data.validation_path is not None else data
    encoded = _encode(records=records, data=source, tokenizer=tokenizer, seq_length=seq_length)  # errors name it
    if task == "masked_lm":
        return _masked_lm_examples(encoded=encoded, tokenizer=tokenizer, seed=seed)
    labels = class_labels(values=list(records[data.label_field]) if data.label_field in records.column_names
                          else None, model_config=model_config, data=source, fields=records.column_names)
    return TextExamples(task=task, labels=labels, **encoded)


def _image_part(*, data, part: str, model_config, processor_path: str, seed: int, cache_dir: str | None):
    """The images of one side: the validation folder (`validation_path`), or the `split_records` share of the
    images of data.path in their listed order (`validation_fraction`)."""
    import dataclasses

    from toolkit.data.images import image_examples
    from toolkit.data.validation import PARTS, VALIDATION, split_records, validation_spec

    if part not in PARTS:
        raise DsmtError(f"data part {part!r} is not one of {', '.join(PARTS)}")
    if part == VALIDATION and data.validation_path is None and data.validation_fraction is None:
        raise DsmtError("there is no validation data: set data.validation_path or data.validation_fraction")
    source = validation_spec(data) if part == VALIDATION and data.validation_path is not None else data
    examples = image_examples(data=source, model_config=model_config, processor_path=processor_path,
                              cache_dir=cache_dir)
    if data.validation_fraction is None:
        return examples
    split = split_records(num_records=len(examples), fraction=data.validation_fraction, seed=seed)
    kept = split.validation if part == VALIDATION else split.train
    return dataclasses.replace(examples, sources=[examples.sources[i] for i in kept],
                               labels=examples.labels[torch.tensor(kept, dtype=torch.int64)])


def _print_on_rank0(message: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _encode(*, records, data, tokenizer, seq_length: int) -> dict[str, torch.Tensor]:
    """One row per record: truncated at `seq_length`, padded to it with the pad token (attention_mask 0)."""
    if tokenizer.pad_token_id is None:
        raise DsmtError(f"the tokenizer of this model has no pad token, which padding to seq_length={seq_length} "
                        f"needs; set one (tokenizer.pad_token = ...) and save it, or set data.tokenizer")
    texts = list(records[data.text_field])
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise DsmtError(f"record {index + 1} of data.path={data.path!r}: {data.text_field}={text!r} is "
                            f"{type(text).__name__}, not text; fix the record or set data.text_field")
    encoded = tokenizer(texts, truncation=True, max_length=seq_length, padding="max_length",
                        return_special_tokens_mask=True, return_tensors="pt")
    out = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
           # padding is never masked, whatever the tokenizer's special-token list says
           "special_tokens_mask": encoded["special_tokens_mask"].bool() | (encoded["attention_mask"] == 0)}
    if "token_type_ids" in encoded:
        out["token_type_ids"] = encoded["token_type_ids"]
    return out


def _masked_lm_examples(*, encoded: dict, tokenizer, seed: int) -> TextExamples:
    from transformers import DataCollatorForLanguageModeling

    if tokenizer.mask_token is None:
        raise DsmtError(f"masked LM needs a mask token, and the tokenizer ({type(tokenizer).__name__}) has none; "
                        f"use the checkpoint's own tokenizer (data.tokenizer) or a *ForCausalLM model")
    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY)
    return TextExamples(task="masked_lm", collator=collator, seed=seed, **encoded)


def _causal_examples(*, data, tokenizer, seq_length: int, cache_dir: str | None, part: str = "train",
                     seed: int = 0) -> TextExamples:
    """`toolkit.data.tokenize` rows of `seq_length` tokens (its `seq_length - 1` + the shifted label), one record
    per row whatever data.packing says: a plain HF model has no per-record attention. HF shifts `labels` itself,
    so labels = input_ids with -100 where the row's loss_mask says no loss."""
    from toolkit.data.pipeline import part_examples

    if seq_length < 2:
        raise DsmtError(f"seq_length={seq_length}: causal LM needs at least 2 tokens (one input, one label)")
    examples = part_examples(data=data.model_copy(update={"packing": False}), part=part, seed=seed,
                             tokenizer=tokenizer, seq_length=seq_length - 1, cache_dir=cache_dir)
    ids = examples.token_ids
    labels = ids.clone()
    labels[:, 1:] = torch.where(examples.loss_mask.bool(), ids[:, 1:], -100)  # label 0 is never predicted
    return TextExamples(task="causal_lm", input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def class_labels(*, values: list | None, model_config, data, fields) -> torch.Tensor:
    """`values` of `data.label_field` as the HF head takes them: int64 class ids, or float32 targets when
    num_labels == 1 (regression, MSE). Names map through config.label2id when the config names its classes."""
    if values is None:
        raise LabelFieldMissingError(
            f"record 1 of data.path={data.path!r} has no field {data.label_field!r} (data.label_field); fields "
            f"found: {', '.join(fields)}; set data.label_field to the field holding the labels")
    missing = next((index for index, value in enumerate(values) if value is None), None)
    if missing is not None:
        raise LabelFieldMissingError(
            f"record {missing + 1} of data.path={data.path!r} has no value for {data.label_field!r} "
            f"(data.label_field); fields found: {', '.join(fields)}; give every record a label")
    num_labels = int(model_config.num_labels)
    if num_labels == 1:
        return torch.tensor([_regression_target(v, index=i, data=data) for i, v in enumerate(values)],
                            dtype=torch.float32)
    names = named_labels(model_config)
    ids = [_class_id(v, index=i, data=data, names=names) for i, v in enumerate(values)]
    check_num_labels(label_ids=ids, num_labels=num_labels, what=f"{data.label_field!r} of data.path={data.path!r}")
    return torch.tensor(ids, dtype=torch.int64)


def _regression_target(value, *, index: int, data) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LabelTypeError(
            f"record {index + 1} of data.path={data.path!r}: {data.label_field}={value!r} is {type(value).__name__}; "
            f"num_labels=1 is regression (MSE) and needs a number; fix the record, or re-save the model with "
            f"num_labels=N for classification")
    return float(value)


def _class_id(value, *, index: int, data, names: dict[str, int] | None) -> int:
    if isinstance(value, str) and names is not None:
        if value not in names:
            raise LabelTypeError(
                f"record {index + 1} of data.path={data.path!r}: {data.label_field}={value!r} is not a class name of "
                f"config.label2id ({', '.join(names)}); fix the record or the model's label2id")
        return names[value]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    fix = ("name classes in config.json's label2id/id2label to use strings" if isinstance(value, str)
           else "classification needs int class ids (num_labels=1 is regression)")
    raise LabelTypeError(
        f"record {index + 1} of data.path={data.path!r}: {data.label_field}={value!r} is {type(value).__name__}, "
        f"not an int class id; {fix}")


class TaskBatches(MicroBatches):
    """The micro-batches of data-parallel rank `dp_rank` for any step, as HF keyword inputs:
    `TaskBatches(*, examples: TaskExamples, micro_batch_size, num_microbatches, dp_rank, dp_size, seed, shuffle)`.
    The sample order is `MicroBatches`' (module docstring of toolkit/data/batches.py); only the rows differ."""

    def global_positions(self, *, step: int) -> torch.Tensor:
        """Global sample positions g of `step`, in position order j (int64 `[G]`)."""
        return torch.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)

    def batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's `num_microbatches` micro-batches for `step`, each `micro_batch_size` rows."""
        indices = self.rank_sample_indices(step=step)
        positions = self.global_positions(step=step).view(self.num_microbatches, self.dp_size,
                                                          self.micro_batch_size)[:, self.dp_rank, :]
        return [self.examples.batch(indices=rows, positions=where) for rows, where in zip(indices, positions)]

    def global_batch_for_step(self, step: int) -> dict[str, torch.Tensor]:
        """All `G` samples of `step` as one batch, rows in position order j."""
        return self.examples.batch(indices=self.global_sample_indices(step=step),
                                   positions=self.global_positions(step=step))
