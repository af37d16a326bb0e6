"""`dsmt data prepare`: text corpora -> a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) and a sidecar.

Each document is the tokenizer's ids of one record's text (its default special tokens, BOS where it adds one)
followed by EOS, as Megatron's preprocess_data.py writes with `--append-eod` (a tokenizer that already ends with EOS
gets no second one, the rule of toolkit/data/tokenize.py). Empty texts are skipped and counted, as Megatron skips
empty documents. The files are megatron-core's own (`IndexedDatasetBuilder`), so `IndexedDataset(PREFIX)` reads
them back; `PREFIX.dsmt.json` (the sidecar) says which tokenizer made them and what they hold.

Records stream through (toolkit/data/prepare_inputs.py): a corpus larger than memory works. The parent reads
chunks of `CHUNK_TEXTS` texts; with `workers > 1` a process pool tokenises them, at most `CHUNKS_PER_WORKER *
workers` chunks in flight, and the parent writes the results in input order, so the output does not depend on
`workers`. Everything is written to `PREFIX.tmp-<pid>.*` first and renamed into place only after success: the
.bin, then the sidecar, then the .idx, the file that makes a corpus look valid. Any failure (Ctrl-C included)
removes the temporaries and leaves an earlier complete PREFIX.* as it was; a full disk is the named error
`disk_full` (toolkit/data/prepare_space.py). A run killed outright (kill -9) leaves its temporaries: the next run
into the same PREFIX removes those whose pid no longer runs, and says so.

The sidecar records both files' sizes and xxh3_128 digests (`files`), which every reader checks
(toolkit/data/corpus_check.py): the sizes always, the digests on `dsmt check --deep` and at training start.
Hashing costs one read of the files just written (from the page cache: ~0.3 s per GB on a shared 2-core machine).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.data.prepare_inputs import resolve_inputs, text_chunks
from toolkit.data.prepare_space import (TEMP_SUFFIXES, disk_full_error, remove_stale_temporaries, temporary_bytes,
                                        temporary_prefix)
from toolkit.errors import DsmtError

SIDECAR_SUFFIX = ".dsmt.json"
SIDECAR_FORMAT = "dsmt-indexed/1"
# What a reader of the sidecar may rely on (the training reader uses eod_id, max_token_id, vocab_size and
# tokenizer_identity). `files` (each file's size and digest, toolkit/data/corpus_check.py) is written by every run
# but optional to read: sidecars written before it have none, and their corpora get the checks of the .idx only.
SIDECAR_KEYS = ("format", "tokenizer", "tokenizer_identity", "tokenizer_class", "vocab_size", "eod_id",
                "max_token_id", "num_documents", "num_tokens", "num_skipped_empty", "text_field", "inputs")
CHUNK_TEXTS = 1000  # texts per tokenizer call: enough for the fast tokenizer's batching, small to ship to a worker
CHUNKS_PER_WORKER = 2  # in flight per worker: one being tokenised, one queued, so no worker waits on the parent
MAX_DEFAULT_WORKERS = 4
WORKER_CHECK_S = 1.0  # how often a wait for a chunk checks that no worker has died


@dataclass(frozen=True)
class TokenizedChunk:
    ids: np.ndarray  # int32: every kept document's ids, EOS included, back to back
    lengths: np.ndarray  # int64: tokens per kept document
    num_skipped_empty: int
    num_text_chars: int  # of all the chunk's texts: a full disk's message estimates the corpus size from it


@dataclass
class CorpusCounts:
    num_documents: int = 0
    num_tokens: int = 0
    num_skipped_empty: int = 0
    max_token_id: int = -1
    num_text_chars: int = 0

    def add(self, chunk: TokenizedChunk) -> None:
        self.num_text_chars += chunk.num_text_chars
        self.num_documents += len(chunk.lengths)
        self.num_tokens += int(chunk.lengths.sum())
        self.num_skipped_empty += chunk.num_skipped_empty
        if len(chunk.ids):
            self.max_token_id = max(self.max_token_id, int(chunk.ids.max()))


@dataclass(frozen=True)
class PrepareSummary:
    prefix: str
    counts: CorpusCounts
    num_bytes: int  # .bin + .idx
    seconds: float  # the work, imports excluded: tokenizer load, pool start, reading, writing, renames

    def line(self) -> str:
        counts = self.counts
        skipped = f" ({counts.num_skipped_empty:,} empty texts skipped)" if counts.num_skipped_empty else ""
        return (f"prepared {self.prefix}.bin/.idx: {counts.num_documents:,} documents{skipped}, "
                f"{counts.num_tokens:,} tokens, {self.num_bytes / 1e6:.2f} MB (.bin + .idx), {self.seconds:.2f} s, "
                f"{counts.num_tokens / max(self.seconds, 1e-9):,.0f} tokens/s")


def default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, MAX_DEFAULT_WORKERS)


def prepare_corpus(*, inputs: list[str | Path], tokenizer_dir: str | Path, output_prefix: str | Path,
                   text_field: str = "text", workers: int | None = None, split: str = "train",
                   show_progress: bool = True) -> PrepareSummary:
    """Tokenise `inputs` (concatenated in order) into `output_prefix`.bin/.idx/.dsmt.json; see the module doc."""
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise DsmtError(f"workers={workers} must be at least 1 (1 tokenises in this process, no pool)")
    sources = resolve_inputs(inputs=inputs)
    prefix = checked_prefix(output_prefix)
    removed = remove_stale_temporaries(prefix)
    if removed:
        print(removed, file=sys.stderr, flush=True)
    _import_libraries()
    from megatron.core.datasets.indexed_dataset import DType

    started = time.perf_counter()
    tokenizer = load_prepare_tokenizer(tokenizer_dir)
    dtype = DType.optimal_dtype(len(tokenizer))  # uint16 below 65,500 ids, as preprocess_data.py chooses
    temp, counts = temporary_prefix(prefix), CorpusCounts()
    try:
        _write_temporaries(temp=temp, chunks=text_chunks(sources=sources, text_field=text_field, split=split,
                                                         chunk_texts=CHUNK_TEXTS),
                           tokenizer=tokenizer, tokenizer_dir=tokenizer_dir, workers=workers, dtype=dtype,
                           counts=counts, show_progress=show_progress)
        write_sidecar(prefix=temp, meta=_sidecar_meta(tokenizer=tokenizer, tokenizer_dir=tokenizer_dir, counts=counts,
                                                      text_field=text_field, sources=sources, files_of=temp))
        _publish(temp=temp, prefix=prefix)
    except BaseException as err:
        written_bytes = temporary_bytes(temp)
        _remove_temporaries(temp)
        full = disk_full_error(err, prefix=prefix, written_bytes=written_bytes, counts=counts,
                               itemsize=np.dtype(dtype).itemsize, inputs=[source.path for source in sources])
        if full is not None:
            raise full from err
        raise
    num_bytes = sum(Path(prefix + suffix).stat().st_size for suffix in (".bin", ".idx"))
    return PrepareSummary(prefix=prefix, counts=counts, num_bytes=num_bytes, seconds=time.perf_counter() - started)


def _import_libraries() -> None:
    """The heavy imports (megatron-core alone takes seconds), done before the clock starts."""
    import datasets  # noqa: F401
    import megatron.core.datasets.indexed_dataset  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401  (the first access of it builds transformers' lazy index)

    import toolkit.data.tokenize  # noqa: F401


def checked_prefix(output_prefix: str | Path) -> str:
    """The absolute output prefix, its directory checked to exist (nothing is created)."""
    path = Path(output_prefix).expanduser()
    if path.is_dir():
        raise DsmtError(f"--output {output_prefix} is a directory, but it is a file prefix: give e.g. "
                        f"{path / 'corpus'} (writes corpus.bin, corpus.idx and corpus{SIDECAR_SUFFIX} there)")
    if not path.parent.is_dir():
        raise DsmtError(f"--output {output_prefix}: the directory {path.parent} does not exist; create it "
                        f"(mkdir -p {path.parent}) or choose a prefix in an existing directory")
    return str(path.resolve())


def load_prepare_tokenizer(tokenizer_dir: str | Path):
    """`AutoTokenizer.from_pretrained(tokenizer_dir)`, checked to load from a local directory and to have an EOS."""
    path = Path(tokenizer_dir).expanduser()
    if not path.is_dir():
        raise DsmtError(f"--tokenizer {tokenizer_dir} is not a directory; give a local directory holding "
                        f"tokenizer.json / tokenizer_config.json (a checkpoint's, or one saved with save_pretrained)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:  # OSError, ValueError, and the tokenizer classes' own errors for damaged files
        raise DsmtError(f"--tokenizer {tokenizer_dir}: AutoTokenizer.from_pretrained failed ({type(err).__name__}: "
                        f"{err}); give a directory holding tokenizer.json / tokenizer_config.json") from err
    if tokenizer.eos_token_id is None:
        raise DsmtError(f"--tokenizer {tokenizer_dir} has no eos_token; every document ends with EOS (Megatron's "
                        f"--append-eod), so set eos_token in its tokenizer_config.json")
    return tokenizer


def tokenize_chunk(*, tokenizer, texts: list[str]) -> TokenizedChunk:
    """Each text's ids with the tokenizer's default special tokens, plus EOS unless they end with it already.
    Empty texts, and texts the tokenizer turns into no ids at all, are skipped (Megatron skips empty documents)."""
    eos = tokenizer.eos_token_id
    kept = [text for text in texts if text]
    docs = [doc for doc in (tokenizer(kept)["input_ids"] if kept else []) if doc]
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    num_text_chars = sum(map(len, kept))
    ids = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int32, count=int(lengths.sum()))
    ends = np.cumsum(lengths)  # one past each document's last id
    needs_eos = ids[ends - 1] != eos
    ids = np.insert(ids, ends[needs_eos], eos)  # in numpy, not a copy of each document's list in Python
    return TokenizedChunk(ids=ids, lengths=lengths + needs_eos, num_skipped_empty=len(texts) - len(docs),
                          num_text_chars=num_text_chars)


_worker_tokenizer = None  # each pool worker's own, loaded once by `_start_worker`


def _start_worker(tokenizer_dir: str, starts) -> None:
    global _worker_tokenizer
    with starts.get_lock():  # counted: a pool replaces a worker that died, and the chunk it held is lost
        starts.value += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it terminates the pool
    # one core per worker: the Rust tokenizer's own thread pool in every worker would oversubscribe the CPUs
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_prepare_tokenizer(tokenizer_dir)


def _tokenize_in_worker(texts: list[str]) -> TokenizedChunk:
    return tokenize_chunk(tokenizer=_worker_tokenizer, texts=texts)


def tokenized_chunks(*, chunks, tokenizer, tokenizer_dir: str | Path, workers: int):
    """`tokenize_chunk` of every chunk, in order: in this process (workers=1) or a pool, `CHUNKS_PER_WORKER *
    workers` chunks at most in flight (`Pool.imap` would read the whole stream ahead into memory)."""
    if workers == 1:
        for texts in chunks:
            yield tokenize_chunk(tokenizer=tokenizer, texts=texts)
        return
    import multiprocessing

    context = multiprocessing.get_context()
    starts = context.Value("i", 0)
    # the pool starts (forks) before the first record is read, so no reader thread or open stream is copied
    with context.Pool(workers, initializer=_start_worker,
                      initargs=(str(Path(tokenizer_dir).expanduser()), starts)) as pool:
        pending = collections.deque()
        for texts in chunks:
            if len(pending) >= CHUNKS_PER_WORKER * workers:
                yield _worker_result(pending.popleft(), starts=starts, workers=workers)
            pending.append(pool.apply_async(_tokenize_in_worker, (texts,)))
        while pending:
            yield _worker_result(pending.popleft(), starts=starts, workers=workers)


def _worker_result(result, *, starts, workers: int) -> TokenizedChunk:
    """`result.get()`, or an error once a worker has died: its chunk would never come and `get` wait forever."""
    while not result.ready():
        if starts.value > workers:
            raise DsmtError(f"a tokenizer worker process died ({starts.value - workers} of {workers} replaced), "
                            f"most likely killed by the OS for memory; run again with fewer --workers (or "
                            f"--workers 1), and check the kernel log (dmesg) for the reason")
        result.wait(WORKER_CHECK_S)
    return result.get()


def _write_temporaries(*, temp: str, chunks, tokenizer, tokenizer_dir, workers: int, dtype, counts: CorpusCounts,
                       show_progress: bool) -> None:
    """`temp`.bin and `temp`.idx from the chunks, `counts` counting what was tokenised (also when a write fails);
    raises (leaving the temporaries to the caller) on zero documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    builder = IndexedDatasetBuilder(temp + ".bin", dtype=dtype)
    bar = tqdm(unit=" docs", file=sys.stderr, disable=not show_progress, desc="tokenising", dynamic_ncols=True)
    try:
        with contextlib.closing(tokenized_chunks(chunks=chunks, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                                                 workers=workers)) as tokenized:
            for chunk in tokenized:
                _check_id_range(chunk=chunk, dtype=dtype, vocab_size=len(tokenizer))
                counts.add(chunk)  # before the writes: a full disk's estimate then has this chunk's ratio too
                # numpy slices, not torch tensors: add_document only does numpy.array(document, dtype) with
                # either, and a torch slice per document costs 7x as much (~0.1 s per 5,000 documents)
                starts = np.cumsum(chunk.lengths) - chunk.lengths
                for start, length in zip(starts.tolist(), chunk.lengths.tolist()):
                    builder.add_document(chunk.ids[start:start + length], lengths=[length])
                bar.update(len(chunk.lengths))
                bar.set_postfix_str(f"{counts.num_tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tokens/s",
                                    refresh=False)
    except BaseException:
        builder.data_file.close()
        raise
    finally:
        bar.close()
    if counts.num_documents == 0:
        builder.data_file.close()
        raise DsmtError(f"no documents: every one of the {counts.num_skipped_empty:,} records read has an empty text; "
                        f"check --text-field and --split, or give inputs with text")
    builder.finalize(temp + ".idx")


def _check_id_range(*, chunk: TokenizedChunk, dtype, vocab_size: int) -> None:
    # DType.optimal_dtype trusts len(tokenizer); an id past it would wrap around silently in uint16
    largest = int(chunk.ids.max()) if len(chunk.ids) else 0
    if largest > np.iinfo(dtype).max:
        raise DsmtError(f"token id {largest} does not fit {np.dtype(dtype).name}, chosen from the tokenizer's "
                        f"vocabulary of {vocab_size}; the tokenizer's len() must count every id it produces")


def _sidecar_meta(*, tokenizer, tokenizer_dir, counts: CorpusCounts, text_field: str, sources, files_of: str) -> dict:
    """The sidecar of the corpus written at `files_of`.bin/.idx (the temporaries: renaming keeps their bytes)."""
    from toolkit.data.corpus_check import sidecar_files
    from toolkit.data.tokenize import tokenizer_identity

    return {"format": SIDECAR_FORMAT, "tokenizer": str(Path(tokenizer_dir).expanduser().resolve()),
            "tokenizer_identity": tokenizer_identity(tokenizer), "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer), "eod_id": tokenizer.eos_token_id, "max_token_id": counts.max_token_id,
            "num_documents": counts.num_documents, "num_tokens": counts.num_tokens,
            "num_skipped_empty": counts.num_skipped_empty, "text_field": text_field,
            "inputs": [str(source.path) for source in sources], "files": sidecar_files(files_of)}


def missing_corpus_files(prefix: str | Path) -> list[str]:
    """Which of `prefix`.bin / `prefix`.idx are not there (a corpus needs both)."""
    base = Path(prefix).expanduser()
    return [f"{base}{suffix}" for suffix in (".bin", ".idx") if not Path(f"{base}{suffix}").is_file()]


def write_sidecar(*, prefix: str | Path, meta: dict) -> Path:
    """`prefix`.dsmt.json holding `meta` (every key of `SIDECAR_KEYS`)."""
    missing = [key for key in SIDECAR_KEYS if key not in meta]
    if missing:
        raise DsmtError(f"sidecar for {prefix} lacks {', '.join(missing)}; a {SIDECAR_FORMAT} sidecar has "
                        f"{', '.join(SIDECAR_KEYS)}")
    path = Path(f"{prefix}{SIDECAR_SUFFIX}")
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


def read_sidecar(prefix: str | Path) -> dict | None:
    """The sidecar `dsmt data prepare` wrote beside `prefix`.bin/.idx, or None where there is none (a corpus
    made by other tools)."""
    path = Path(f"{prefix}{SIDECAR_SUFFIX}")
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DsmtError(f"{path} is not readable JSON ({err}); re-run dsmt data prepare for {prefix}, or delete "
                        f"the file to use the corpus without its checks") from err
    problems = []
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        problems.append(f"format is {found!r}, not {SIDECAR_FORMAT!r}")
    else:
        from toolkit.data.corpus_check import files_entry_problem

        problems += [f"{key} is missing" for key in SIDECAR_KEYS if key not in meta]
        problems += [problem for problem in [files_entry_problem(meta.get("files"))] if problem]
    if problems:
        raise DsmtError(f"{path}: {'; '.join(problems)}; re-run dsmt data prepare for {prefix}, or delete the file "
                        f"to use the corpus without its checks")
    return meta


def _publish(*, temp: str, prefix: str) -> None:
    # An old .idx goes first, so that between the renames the prefix has no .idx (looks unfinished) rather than a
    # new .bin under an old index; the new .idx comes last.
    Path(prefix + ".idx").unlink(missing_ok=True)
    os.replace(temp + ".bin", prefix + ".bin")
    os.replace(temp + SIDECAR_SUFFIX, prefix + SIDECAR_SUFFIX)
    os.replace(temp + ".idx", prefix + ".idx")


def _remove_temporaries(temp: str) -> None:
    for suffix in TEMP_SUFFIXES:
        Path(temp + suffix).unlink(missing_ok=True)
