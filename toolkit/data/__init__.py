"""The training data pipeline, one module per stage:

    source (`sources`: file, folder, cached name; `indexed`: Megatron corpora) -> records of a part
    (`validation`) -> formatting by `data.type` (`formats`, `records`) -> tokenisation (`tokenize`) -> long
    records and packing (`packing`; preference pairs: `preference`, `preference_rows`) -> cache (`cache`) -> rows
    (`examples`, `mix`) -> micro-batches (`batches`).

`pipeline.build_examples` runs the record stages in one process; `training.job_rows` gives a training job the rows
of any source kind (records cached once per job and memory-mapped on every rank; Megatron corpora through
megatron-core's datasets; mixes); `prepare` writes Megatron corpora (`dsmt data prepare`), `corpus_check` checks
them wherever they are opened."""

from __future__ import annotations

import importlib

# name -> module: loaded on first use, so `dsmt` (which imports toolkit.data.cli to build its parser) and
# `dsmt check` stay free of torch until a command needs it
_EXPORTS = {
    "FIRST_STAGE_KEYS": "batches", "LAST_STAGE_KEYS": "batches", "MicroBatches": "batches", "stage_inputs": "batches",
    "cache_root_for": "cache", "open_cache": "cache", "prepare_cache": "cache", "Examples": "examples",
    "build_examples": "pipeline", "FILE_BUILDERS": "sources", "load_records": "sources",
    "required_fields": "records", "synthetic_examples": "synthetic", "assistant_spans": "tokenize",
    "load_tokenizer": "tokenize", "record_kind": "tokenize", "tokenize_examples": "tokenize",
    "job_rows": "training", "PreferenceBatches": "batches", "PreferenceExamples": "preference_rows",
    "PreferenceError": "preference_rows", "format_preference": "formats", "tokenize_preference": "preference",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'toolkit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"toolkit.data.{_EXPORTS[name]}"), name)
