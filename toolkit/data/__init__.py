"""The training data pipeline: records (`sources`) -> fixed-length examples (`tokenize`, `synthetic`) ->
per-rank micro-batches (`batches`). `build_examples` wires the first two from a `DataSpec` in one process;
`shared_examples` (`cache`) does it once per job, on disk, and memory-maps the result on every rank."""

from __future__ import annotations

from toolkit.data.batches import FIRST_STAGE_KEYS, LAST_STAGE_KEYS, MicroBatches, stage_inputs
from toolkit.data.cache import cache_root_for, open_cache, prepare_cache, shared_examples
from toolkit.data.examples import build_examples
from toolkit.data.sources import FILE_BUILDERS, load_records, required_fields
from toolkit.data.synthetic import synthetic_examples
from toolkit.data.tokenize import Examples, assistant_spans, load_tokenizer, record_kind, tokenize_examples

__all__ = ["FILE_BUILDERS", "FIRST_STAGE_KEYS", "LAST_STAGE_KEYS", "Examples", "MicroBatches", "assistant_spans",
           "build_examples", "cache_root_for", "load_records", "load_tokenizer", "open_cache", "prepare_cache",
           "record_kind", "required_fields", "shared_examples", "stage_inputs", "synthetic_examples",
           "tokenize_examples"]
