"""Records to rows in this process, one stage after the other:

    source (sources.py: file, folder, cached name) -> records of one part (validation.py: train / validation)
    -> formatting by type (formats.py) -> tokenisation (tokenize.py) -> long records and packing (packing.py)

This is the uncached path; a training job goes through toolkit/data/training.py, which runs it once per job
(rank 0, toolkit/data/cache.py) and memory-maps the result everywhere else."""

from __future__ import annotations

from toolkit.data.examples import Examples, check_vocab
from toolkit.data.synthetic import synthetic_examples
from toolkit.data.tokenize import load_tokenizer, tokenize_examples
from toolkit.data.validation import TRAIN, ValidationDataError, describe_source, part_records
from toolkit.errors import DsmtError
from toolkit.spec.schema import DATA_SOURCE_FIX, DataSpec


def require_data_path(data: DataSpec) -> None:
    if data.path is None and data.blend is None and data.mix is None:  # `dsmt check` reports this as data_source
        raise DsmtError(f"data_source: data.path is unset and data.synthetic=false, so there is no data to train "
                        f"on; {DATA_SOURCE_FIX}")


def build_examples(*, data: DataSpec, model_path: str | None, seq_length: int, vocab_size: int, seed: int,
                   num_synthetic_examples: int = 1024, cache_dir: str | None = None) -> Examples:
    """Examples for `data`: synthetic ones when `data.synthetic`, else `data.path` tokenised with `data.tokenizer`
    or the checkpoint's tokenizer at `model_path`. `cache_dir` is the `datasets` cache (None: its default)."""
    if data.synthetic:
        return synthetic_examples(vocab_size=vocab_size, seq_length=seq_length, num_examples=num_synthetic_examples,
                                  seed=seed)
    require_data_path(data)
    tokenizer = load_tokenizer(data=data, model_path=model_path)
    examples = part_examples(data=data, part=TRAIN, seed=seed, tokenizer=tokenizer, seq_length=seq_length,
                             cache_dir=cache_dir)
    check_vocab(largest_id=examples.max_token_id(), vocab_size=vocab_size, tokenizer_ref=data.tokenizer)
    return examples


def part_examples(*, data: DataSpec, part: str, seed: int, tokenizer, seq_length: int,
                  cache_dir: str | None = None) -> Examples:
    """The records of `part` ("train" or "validation", toolkit/data/validation.py) formatted, tokenised and
    packed: what the on-disk cache stores for `part`."""
    records = part_records(data=data, part=part, seed=seed, cache_dir=cache_dir)
    try:
        return tokenize_examples(records=records, data=data, tokenizer=tokenizer, seq_length=seq_length)
    except DsmtError as err:
        if part == TRAIN:
            raise
        raise ValidationDataError(f"the validation records ({describe_source(data)}): {err}") from err
