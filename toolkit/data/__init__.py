"""The training data pipeline: records (`sources`) -> fixed-length examples (`tokenize`, `synthetic`) ->
per-rank micro-batches (`batches`). `build_examples` wires the first two from a `DataSpec`."""

from __future__ import annotations

from toolkit.data.batches import FIRST_STAGE_KEYS, LAST_STAGE_KEYS, MicroBatches, stage_inputs
from toolkit.data.sources import FILE_BUILDERS, load_records, required_fields
from toolkit.data.synthetic import synthetic_examples
from toolkit.data.tokenize import Examples, assistant_spans, load_tokenizer, record_kind, tokenize_examples
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

__all__ = ["FILE_BUILDERS", "FIRST_STAGE_KEYS", "LAST_STAGE_KEYS", "Examples", "MicroBatches", "assistant_spans",
           "build_examples", "load_records", "load_tokenizer", "record_kind", "required_fields", "stage_inputs",
           "synthetic_examples", "tokenize_examples"]


def build_examples(*, data: DataSpec, model_path: str | None, seq_length: int, vocab_size: int, seed: int,
                   num_synthetic_examples: int = 1024, cache_dir: str | None = None) -> Examples:
    """Examples for `data`: synthetic ones when `data.path` is None, else `data.path` tokenised with
    `data.tokenizer` or the checkpoint's tokenizer at `model_path`."""
    if data.path is None:
        return synthetic_examples(vocab_size=vocab_size, seq_length=seq_length, num_examples=num_synthetic_examples,
                                  seed=seed)
    tokenizer = load_tokenizer(data=data, model_path=model_path)
    records = load_records(data=data, cache_dir=cache_dir)
    examples = tokenize_examples(records=records, data=data, tokenizer=tokenizer, seq_length=seq_length)
    largest = int(examples.token_ids.max())
    if largest >= vocab_size:  # an embedding lookup past the table fails far from here, or silently on GPU
        raise DsmtError(f"the tokenizer produced id {largest} but the model's vocab_size is {vocab_size}; use the "
                        f"checkpoint's own tokenizer (data.tokenizer={data.tokenizer!r})")
    return examples
