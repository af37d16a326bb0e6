"""`DataSpec` -> `Examples` in this process: synthetic sequences, or `data.path` read and tokenised.

This is the uncached path; a training job goes through `toolkit.data.cache.shared_examples`, which runs it once
(rank 0) and memory-maps the result everywhere else."""

from __future__ import annotations

from toolkit.data.sources import load_records
from toolkit.data.synthetic import synthetic_examples
from toolkit.data.tokenize import Examples, load_tokenizer, tokenize_examples
from toolkit.errors import DsmtError
from toolkit.spec.schema import DATA_SOURCE_FIX, DataSpec


def build_examples(*, data: DataSpec, model_path: str | None, seq_length: int, vocab_size: int, seed: int,
                   num_synthetic_examples: int = 1024, cache_dir: str | None = None) -> Examples:
    """Examples for `data`: synthetic ones when `data.synthetic`, else `data.path` tokenised with `data.tokenizer`
    or the checkpoint's tokenizer at `model_path`. `cache_dir` is the `datasets` cache (None: its default)."""
    if data.synthetic:
        return synthetic_examples(vocab_size=vocab_size, seq_length=seq_length, num_examples=num_synthetic_examples,
                                  seed=seed)
    require_data_path(data)
    tokenizer = load_tokenizer(data=data, model_path=model_path)
    examples = tokenize_path(data=data, tokenizer=tokenizer, seq_length=seq_length, cache_dir=cache_dir)
    check_vocab(largest_id=int(examples.token_ids.max()), vocab_size=vocab_size, data=data)
    return examples


def require_data_path(data: DataSpec) -> None:
    if data.path is None:  # `dsmt check` reports this as rule data_source; callers that skip it land here
        raise DsmtError(f"data_source: data.path is unset and data.synthetic=false, so there is no data to train "
                        f"on; {DATA_SOURCE_FIX}")


def tokenize_path(*, data: DataSpec, tokenizer, seq_length: int, cache_dir: str | None = None) -> Examples:
    """Read `data.path` and tokenise every record: the expensive step the on-disk cache runs once per job."""
    records = load_records(data=data, cache_dir=cache_dir)
    return tokenize_examples(records=records, data=data, tokenizer=tokenizer, seq_length=seq_length)


def check_vocab(*, largest_id: int, vocab_size: int, data: DataSpec) -> None:
    if largest_id >= vocab_size:  # an embedding lookup past the table fails far from here, or silently on GPU
        raise DsmtError(f"the tokenizer produced id {largest_id} but the model's vocab_size is {vocab_size}; use the "
                        f"checkpoint's own tokenizer (data.tokenizer={data.tokenizer!r})")
