"""Tokenised examples cached on disk and memory-mapped: a job tokenises its corpus once, on rank 0.

    <cache_root>/<key>/token_ids.npy   int64   [N, seq_length + 1]
    <cache_root>/<key>/loss_mask.npy   float32 [N, seq_length]
    <cache_root>/<key>/position_ids.npy int32  [N, seq_length]   restarting at 0 at each packed record
    <cache_root>/<key>/meta.json       what the key was made of, the `Examples` counters, the largest token id

Preference pairs (`PreferenceExamples`, toolkit/data/preference_rows.py) keep the same three arrays over their
`N * rows_per_pair` rows, plus `sequence.npy` (int8 [N * rows_per_pair, seq_length], the side of each label) and
`rows_per_pair` / `num_pairs` in meta.json; `num_examples` is then the pairs.

`key` is a hash of everything the arrays depend on: `FORMAT_VERSION`, the `DataSpec` fields that shape
tokenisation, the tokenizer itself (class, serialised pipeline or vocabulary, special ids, chat template),
`seq_length`, and the source's identity (path, size and mtime of every file). Editing the data file gives another
key, so a stale cache is never read; old entries stay until deleted. A hub dataset id is keyed by its name and
split only: a new revision on the hub is not noticed.

Rank 0 writes into a temporary directory and renames it into place, so a `<key>` directory that exists is whole
(two jobs racing on one cache keep the first). The other ranks wait for rank 0's word through a status file with a
heartbeat, not a collective, so tokenising a large corpus cannot outlast the process group's timeout
(`toolkit.launch.rank0.on_rank0`, as the export does); then they
memory-map the arrays copy-on-write: ranks on one machine share the page cache, and an in-place write to a tensor
(nothing does one) would stay private instead of crashing on a read-only page or reaching the file. The cache root
must be on a filesystem every node sees, as the checkpoints must.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from toolkit.data import validation
from toolkit.data.examples import Examples, check_vocab
from toolkit.data.pipeline import part_examples, require_data_path
from toolkit.data.preference_rows import PREFERENCE_KIND, PreferenceExamples
from toolkit.data.sources import source_identity
from toolkit.data.tokenize import load_tokenizer, tokenizer_identity
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

log = logging.getLogger(__name__)

# bump when the arrays, the tokenisation rules or the key's inputs change (2: data.packing, position_ids; 3: data.type,
# data.config, data.blend / data.mix in the key's DataSpec fields)
FORMAT_VERSION = 3
META = "meta.json"
# DataSpec fields that do not change the tokens: the order of use, where the cache lives, and `tokenizer`, whose
# location matters less than its content (`tokenizer_identity`).
KEY_EXCLUDED_FIELDS = {"shuffle", "cache_dir", "synthetic", "tokenizer"}


def cache_root_for(*, data: DataSpec, output_dir: str | Path) -> Path:
    return Path(data.cache_dir).expanduser() if data.cache_dir is not None else Path(output_dir) / "data-cache"


def shared_examples(*, data: DataSpec, model_path: str | None, seq_length: int, vocab_size: int, seed: int,
                    cache_root: Path, status_file: Path, part: str = "train") -> Examples | PreferenceExamples:
    """Collective over the default process group: rank 0 tokenises (or reuses the cache), every rank memory-maps
    the result; the others wait on `status_file` (this job's own, on a shared filesystem), and a failure on rank 0
    raises on every rank. Synthetic examples are generated on each rank (cheap, a pure function of the seed).
    `part`: "train" or "validation" (toolkit/data/validation.py: which records; `seed` also draws a held-out share)."""
    from toolkit.launch.rank0 import on_rank0

    def prepare(progress) -> str:
        return str(prepare_cache(data=data, model_path=model_path, seq_length=seq_length, vocab_size=vocab_size,
                                 cache_root=cache_root, part=part, split_seed=seed))

    what = "preparing the validation data" if part == validation.VALIDATION else "preparing the training data"
    directory = on_rank0(prepare, status_file=status_file, what=what)
    return open_cache(Path(directory))


def prepare_cache(*, data: DataSpec, model_path: str | None, seq_length: int, vocab_size: int, cache_root: Path,
                  datasets_cache_dir: str | None = None, part: str = "train", split_seed: int = 0) -> Path:
    """The cache directory for these inputs, tokenising and writing it first when it does not exist yet.
    `datasets_cache_dir` is where `datasets` keeps its own files (None: its default)."""
    require_data_path(data)
    tokenizer = load_tokenizer(data=data, model_path=model_path)
    key, inputs = cache_key(data=data, tokenizer=tokenizer, seq_length=seq_length, part=part, split_seed=split_seed)
    directory = Path(cache_root) / key
    if (directory / META).is_file():
        meta = json.loads((directory / META).read_text())
        log.info("data cache: reusing %s (%d examples)", directory, meta["num_examples"])
    else:
        examples = part_examples(data=data, part=part, seed=split_seed, tokenizer=tokenizer, seq_length=seq_length,
                                 cache_dir=datasets_cache_dir)
        meta = write_cache(directory=directory, examples=examples, inputs=inputs)
        log.info("data cache: tokenised %d examples into %s", meta["num_examples"], directory)
    check_vocab(largest_id=meta["max_token_id"], vocab_size=vocab_size, tokenizer_ref=data.tokenizer)
    return directory


def cache_key(*, data: DataSpec, tokenizer, seq_length: int, part: str = "train",
              split_seed: int = 0) -> tuple[str, dict]:
    """(hex key, the JSON-able inputs it hashes); see the module docstring. `part` / `split_seed`: which records
    (toolkit/data/validation.py `key_inputs`)."""
    # the validation file shapes only the validation part, whose key has its identity (validation.key_inputs)
    fields = data.model_dump(exclude=KEY_EXCLUDED_FIELDS | {"validation_path"})
    inputs = {"format_version": FORMAT_VERSION, "data": fields, "seq_length": seq_length,
              "tokenizer": tokenizer_identity(tokenizer), "source": source_identity(data.path),
              **validation.key_inputs(data=data, part=part, seed=split_seed)}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return digest[:24], inputs


def write_cache(*, directory: Path, examples: Examples | PreferenceExamples, inputs: dict) -> dict:
    """Write `examples` to `directory` atomically (temp dir + rename); returns the metadata written."""
    meta = {"inputs": inputs, "kind": examples.kind, "used_chat_template": examples.used_chat_template,
            "num_dropped": examples.num_dropped, "num_truncated": examples.num_truncated,
            "num_records": examples.num_records, "num_split": getattr(examples, "num_split", 0),
            "num_examples": len(examples), "seq_length": examples.seq_length,
            "max_token_id": int(examples.token_ids.max())}
    arrays = {"token_ids": examples.token_ids.numpy(), "loss_mask": examples.loss_mask.numpy()}
    if isinstance(examples, PreferenceExamples):
        meta.update(rows_per_pair=examples.rows_per_pair, num_pairs=len(examples))
        arrays.update(position_ids=examples.position_ids.to(torch.int32).numpy(),
                      sequence=examples.sequence.to(torch.int8).numpy())
    else:
        arrays["position_ids"] = examples.positions(torch.arange(len(examples))).to(torch.int32).numpy()
    directory.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for name, array in arrays.items():
            np.save(temp / f"{name}.npy", array)
        (temp / META).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(temp, directory)
        except OSError:
            if not (directory / META).is_file():
                raise
            shutil.rmtree(temp)  # another job wrote the same key first; its arrays are the same
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return meta


def open_cache(directory: Path) -> Examples | PreferenceExamples:
    """The cached examples as tensors over copy-on-write memory maps (no copy until rows are gathered)."""
    directory = Path(directory)
    if not (directory / META).is_file():
        raise DsmtError(f"the data cache {directory} written by rank 0 is not visible here; put data.cache_dir "
                        f"(default <training.output_dir>/data-cache) on a filesystem every node shares")
    meta = json.loads((directory / META).read_text())
    preference = meta["kind"] == PREFERENCE_KIND
    names = ("token_ids", "loss_mask", "position_ids") + (("sequence",) if preference else ())
    arrays = {name: torch.from_numpy(np.load(directory / f"{name}.npy", mmap_mode="c")) for name in names}
    num_rows = meta["num_pairs"] * meta["rows_per_pair"] if preference else meta["num_examples"]
    shapes = {name: tuple(array.shape) for name, array in arrays.items()}
    expected = {name: (num_rows, meta["seq_length"] + (name == "token_ids")) for name in names}
    if shapes != expected:
        found = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise DsmtError(f"the data cache {directory} is damaged ({found}, meta says {num_rows} rows of "
                        f"{meta['seq_length']}); delete it")
    counters = {key: meta[key] for key in ("used_chat_template", "num_dropped", "num_truncated", "num_records")}
    if preference:
        return PreferenceExamples(**arrays, rows_per_pair=meta["rows_per_pair"], directory=directory, **counters)
    return Examples(**arrays, kind=meta["kind"], num_split=meta["num_split"], **counters)
