"""A Megatron corpus (`PREFIX.bin` + `PREFIX.idx`) checked before anything trains on it.

megatron-core's IndexedDataset trusts the `.idx`: a sequence length changed there reads other tokens, silently;
a dtype byte changed reads garbage ids or fails at the first batch (an IndexError, a numpy ValueError). So dsmt
checks the files wherever a corpus is opened: `dsmt check`, the dry run, and every rank before it reads.

Cheap, always: a vectorised pass over the `.idx` memory map (in slices of `SCAN_SEQUENCES`, so memory stays
flat; ~10 ms per million sequences), nothing of the `.bin` but its size:
  * the sizes `dsmt data prepare` recorded in its sidecar (`PREFIX.dsmt.json`, key `files`), when there is one;
  * the header: megatron's magic, version 1, a dtype code megatron-core knows;
  * the `.idx` size: the header's sequence and document counts fix it exactly (layout below);
  * the dtype against the `.bin`: sum of lengths x dtype size is the `.bin` size;
  * every sequence inside the `.bin`, each starting where the one before ends (megatron's writer lays them back
    to back, so a changed length or pointer shows as a gap or an overlap);
  * the document indices: 0 first, never decreasing, the sequence count last;
  * the sidecar's document and token counts.
Deep (`dsmt check --deep`; on global rank 0 in a background thread while training starts, `DigestWatch`): the
xxh3_128 digests of both files against the sidecar's. A corpus without a sidecar (Megatron's preprocess_data.py)
gets the cheap checks of its `.idx` only.

The `.idx` layout, as megatron-core's `_IndexWriter` writes it (megatron/core/datasets/indexed_dataset.py):
    magic b"MMIDIDX\\x00\\x00" (9 bytes) | version <Q = 1 | dtype code <B | sequence count S <Q |
    document count D <Q | S x int32 lengths (tokens) | S x int64 pointers (byte offsets into .bin) |
    D x int64 document indices (sequence index where each document starts, then S)
Its constants are copied here (a test holds them equal to megatron-core's): importing megatron-core costs ~5 s of
torch, too much for `dsmt check`.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.data.files import digest_file
from toolkit.errors import RuleError

INDEX_MAGIC = b"MMIDIDX\x00\x00"  # megatron-core's _INDEX_HEADER
INDEX_VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# megatron-core's DType: code -> numpy dtype name
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
SCAN_SEQUENCES = 1 << 22  # per vectorised step: ~100 MB of temporaries at most, whatever the corpus
SIDECAR_FILES = ("bin", "idx")  # the keys of the sidecar's `files` entry
SIDECAR_FILES_SHAPE = '{"bin": {"size": BYTES, "xxh3_128": HEX}, "idx": {"size": BYTES, "xxh3_128": HEX}}'


class CorpusDamaged(RuleError):
    """A corpus whose files contradict themselves or what `dsmt data prepare` recorded (rule `corpus_damaged`)."""

    def __init__(self, detail: str, *, prefix: str):
        super().__init__(detail, rule="corpus_damaged",
                         fix=f"run dsmt data prepare again for {prefix} (its sidecar {prefix}.dsmt.json, where there "
                             "is one, names the inputs and the tokenizer), or copy the corpus again from where it was "
                             "made")


@dataclass(frozen=True)
class IndexFacts:
    num_sequences: int  # one per document as dsmt and preprocess_data.py write them
    num_tokens: int
    dtype: str


def sidecar_files(prefix: str | Path) -> dict:
    """The sidecar's `files` entry for `prefix`.bin/.idx as they are now: each file's size and digest."""
    return {key: {"size": Path(f"{prefix}.{key}").stat().st_size, "xxh3_128": digest_file(Path(f"{prefix}.{key}"))}
            for key in SIDECAR_FILES}


def files_entry_problem(files) -> str | None:
    """What is wrong with a sidecar's `files` entry (None: absent, as in sidecars written before it, or sound)."""
    if files is None:
        return None
    sound = isinstance(files, dict) and all(
        isinstance(files.get(key), dict) and isinstance(files[key].get("size"), int)
        and isinstance(files[key].get("xxh3_128"), str) for key in SIDECAR_FILES)
    return None if sound else f"files is {json.dumps(files)[:120]}, not {SIDECAR_FILES_SHAPE}"


def check_corpus(prefix: str | Path, *, sidecar: dict | None) -> IndexFacts:
    """The cheap checks (module docstring) of `prefix`.bin/.idx, both present; raises CorpusDamaged at the first
    problem (later checks mean little once one failed)."""
    base = str(Path(prefix).expanduser())
    sizes = {key: Path(f"{base}.{key}").stat().st_size for key in SIDECAR_FILES}
    if sidecar is not None and sidecar.get("files"):
        _check_recorded_sizes(base, sizes=sizes, recorded=sidecar["files"])
    code, num_sequences, num_indices = _header(base, idx_bytes=sizes["idx"])
    index = np.memmap(f"{base}.idx", dtype=np.uint8, mode="r")
    lengths = np.frombuffer(index, dtype=np.int32, count=num_sequences, offset=HEADER_BYTES)
    pointers = np.frombuffer(index, dtype=np.int64, count=num_sequences, offset=HEADER_BYTES + 4 * num_sequences)
    documents = np.frombuffer(index, dtype=np.int64, count=num_indices, offset=HEADER_BYTES + 12 * num_sequences)
    num_tokens = sum(int(lengths[i:i + SCAN_SEQUENCES].sum(dtype=np.int64))
                     for i in range(0, num_sequences, SCAN_SEQUENCES))
    _check_dtype(base, code=code, lengths=lengths, pointers=pointers, num_tokens=num_tokens, bin_bytes=sizes["bin"])
    _check_sequences(base, lengths=lengths, pointers=pointers, itemsize=np.dtype(DTYPE_CODES[code]).itemsize,
                     bin_bytes=sizes["bin"])
    _check_documents(base, documents=documents, num_sequences=num_sequences)
    if sidecar is not None:
        _check_recorded_counts(base, num_sequences=num_sequences, num_tokens=num_tokens, sidecar=sidecar)
    return IndexFacts(num_sequences=num_sequences, num_tokens=num_tokens, dtype=DTYPE_CODES[code])


def check_digests(prefix: str | Path, *, sidecar: dict | None) -> int | None:
    """The deep check: both files' xxh3_128 against the sidecar's; the bytes hashed, or None where the sidecar
    records no digests (no sidecar, or one written before dsmt recorded them)."""
    base = str(Path(prefix).expanduser())
    recorded = (sidecar or {}).get("files")
    if not recorded:
        return None
    hashed = 0
    for key in SIDECAR_FILES:
        path = Path(f"{base}.{key}")
        digest, expected = digest_file(path), recorded[key]["xxh3_128"]
        if digest != expected:
            raise CorpusDamaged(f"{path}: its xxh3_128 digest is {digest}, but dsmt data prepare recorded {expected} "
                                f"in {base}.dsmt.json: its bytes changed after it was prepared", prefix=base)
        hashed += path.stat().st_size
    return hashed


def _check_recorded_sizes(base: str, *, sizes: dict, recorded: dict) -> None:
    for key in SIDECAR_FILES:
        if sizes[key] != recorded[key]["size"]:
            raise CorpusDamaged(f"{base}.{key} holds {sizes[key]:,} bytes, but dsmt data prepare wrote "
                                f"{recorded[key]['size']:,} ({base}.dsmt.json): the file was cut short, appended "
                                "to or replaced after it was prepared", prefix=base)


def _header(base: str, *, idx_bytes: int) -> tuple[int, int, int]:
    """(dtype code, sequence count, document index count) of `base`.idx, its size checked against them."""
    path = f"{base}.idx"
    if idx_bytes < HEADER_BYTES:
        raise CorpusDamaged(f"{path} holds {idx_bytes} bytes, less than the {HEADER_BYTES}-byte header of a "
                            "Megatron index", prefix=base)
    with open(path, "rb") as reader:
        magic, version, code, num_sequences, num_indices = struct.unpack("<9sQBQQ", reader.read(HEADER_BYTES))
    if magic != INDEX_MAGIC:
        raise CorpusDamaged(f"{path} starts with {magic!r}, not megatron's index magic {INDEX_MAGIC!r}: it is not "
                            "a Megatron .idx", prefix=base)
    if version != INDEX_VERSION:
        raise CorpusDamaged(f"{path}: index version {version}, megatron-core reads version {INDEX_VERSION}",
                            prefix=base)
    if code not in DTYPE_CODES:
        valid = ", ".join(f"{c} {name}" for c, name in DTYPE_CODES.items())
        raise CorpusDamaged(f"{path}: dtype code {code} (byte 17) is none of megatron-core's ({valid})", prefix=base)
    expected = HEADER_BYTES + 12 * num_sequences + 8 * num_indices
    if idx_bytes != expected:
        raise CorpusDamaged(f"{path} holds {idx_bytes:,} bytes, but its header's {num_sequences:,} sequences and "
                            f"{num_indices:,} document indices take {HEADER_BYTES} + 12 x {num_sequences:,} + 8 x "
                            f"{num_indices:,} = {expected:,}", prefix=base)
    return code, num_sequences, num_indices


def _check_dtype(base: str, *, code: int, lengths, pointers, num_tokens: int, bin_bytes: int) -> None:
    """A dtype code changed: the .bin is the lengths' tokens at another width, and so say the pointers (the writer
    computed them with its own width)."""
    itemsize = np.dtype(DTYPE_CODES[code]).itemsize
    if not len(lengths) or num_tokens * itemsize == bin_bytes:
        return
    before_last = num_tokens - int(lengths[-1])
    for width in sorted({np.dtype(name).itemsize for name in DTYPE_CODES.values()} - {itemsize}):
        if num_tokens * width == bin_bytes and int(pointers[-1]) == before_last * width:
            widths = "/".join(name for name in DTYPE_CODES.values() if np.dtype(name).itemsize == width)
            raise CorpusDamaged(f"{base}.idx says its tokens are {DTYPE_CODES[code]} (dtype code {code}, "
                                f"{_bytes(itemsize)} each), but {base}.bin holds exactly its {num_tokens:,} tokens at "
                                f"{_bytes(width)} each ({widths}), as the index's pointers do: the dtype byte (byte "
                                "17) was changed", prefix=base)


def _bytes(count: int) -> str:
    return "1 byte" if count == 1 else f"{count} bytes"


def _check_sequences(base: str, *, lengths, pointers, itemsize: int, bin_bytes: int) -> None:
    previous_end = 0
    for first in range(0, len(lengths), SCAN_SEQUENCES):
        length = lengths[first:first + SCAN_SEQUENCES].astype(np.int64)
        start = pointers[first:first + SCAN_SEQUENCES]
        end = start + length * itemsize
        outside = (length < 0) | (start < 0) | (start > bin_bytes) | (end > bin_bytes)
        # each sequence starts where the one before it ends: an index where that fails names the earlier one
        gap = start != np.concatenate(([previous_end], end[:-1]))
        bad_outside = int(np.argmax(outside)) if outside.any() else len(length)
        bad_gap = int(np.argmax(gap)) if gap.any() else len(length)
        if bad_outside < len(length) and bad_outside <= bad_gap:
            i = bad_outside
            raise CorpusDamaged(f"{base}.idx: sequence {first + i} has length {int(length[i]):,} at byte "
                                f"{int(start[i]):,}, ending at byte {int(end[i]):,}: past the end of {base}.bin "
                                f"({bin_bytes:,} bytes)", prefix=base)
        if bad_gap < len(length):
            i = first + bad_gap
            if i == 0:
                raise CorpusDamaged(f"{base}.idx: sequence 0 starts at byte {int(pointers[0]):,}, not at 0",
                                    prefix=base)
            raise CorpusDamaged(f"{base}.idx: sequence {i} starts at byte {int(pointers[i]):,}, but sequence "
                                f"{i - 1} (length {int(lengths[i - 1]):,} at byte {int(pointers[i - 1]):,}) ends at "
                                f"byte {int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize:,}: the index's "
                                "lengths and pointers disagree", prefix=base)
        previous_end = int(end[-1])
    if previous_end != bin_bytes:
        raise CorpusDamaged(f"{base}.bin holds {bin_bytes:,} bytes, but its index's sequences end at byte "
                            f"{previous_end:,}: the .bin is another corpus's, or was appended to", prefix=base)


def _check_documents(base: str, *, documents, num_sequences: int) -> None:
    path = f"{base}.idx"
    if not len(documents) or int(documents[0]) != 0 or int(documents[-1]) != num_sequences:
        ends = f"{int(documents[0])} .. {int(documents[-1])}" if len(documents) else "none"
        raise CorpusDamaged(f"{path}: its document indices run {ends}; they must run from 0 to the sequence count "
                            f"{num_sequences:,}", prefix=base)
    for first in range(0, len(documents), SCAN_SEQUENCES):
        part = documents[first:first + SCAN_SEQUENCES + 1]
        falls = np.diff(part) < 0
        if falls.any():
            i = first + int(np.argmax(falls)) + 1
            raise CorpusDamaged(f"{path}: document index {i} is {int(documents[i]):,}, below the one before it "
                                f"({int(documents[i - 1]):,}); they never decrease", prefix=base)


def _check_recorded_counts(base: str, *, num_sequences: int, num_tokens: int, sidecar: dict) -> None:
    recorded = (sidecar["num_documents"], sidecar["num_tokens"])
    if (num_sequences, num_tokens) != recorded:
        raise CorpusDamaged(f"{base}.idx holds {num_sequences:,} sequences of {num_tokens:,} tokens, but dsmt data "
                            f"prepare wrote {recorded[0]:,} documents of {recorded[1]:,} tokens ({base}.dsmt.json): "
                            "the index was replaced or changed after it was prepared", prefix=base)


class DigestWatch:
    """`check_digests` of each (prefix, sidecar) in a background thread, started as training starts (global
    rank 0): the first damage found is printed at once and raised by the next `raise_if_damaged` (the corpus's
    next read on that rank), which fails the run; the other ranks are stopped by the launcher."""

    started: list[DigestWatch] = []  # this process's watches, for `finish_digest_checks`

    def __init__(self, *, corpora: list[tuple[str, dict | None]]):
        self.found: CorpusDamaged | None = None
        self._thread = threading.Thread(target=self._check, args=(corpora,), name="dsmt-corpus-digests", daemon=True)
        self._thread.start()
        DigestWatch.started.append(self)

    def _check(self, corpora) -> None:
        for prefix, sidecar in corpora:
            try:
                check_digests(prefix, sidecar=sidecar)
            except CorpusDamaged as err:
                self.found = err
                print(f"dsmt: {err}\n(the run stops at its next read of the corpus)", file=sys.stderr, flush=True)
                return
            except OSError as err:  # a file gone mid-run: the next read says so itself
                print(f"dsmt: the digest check of {prefix} could not read it ({err})", file=sys.stderr, flush=True)

    def raise_if_damaged(self) -> None:
        if self.found is not None:
            raise self.found

    def wait(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def running(self) -> bool:
        return self._thread.is_alive()


FINISH_WAIT_S = 60.0  # well inside the collective timeout (180 s CPU, 600 s NCCL) the other ranks export under


def finish_digest_checks(*, wait_s: float = FINISH_WAIT_S) -> None:
    """Before a run exports: raise the damage this process's digest checks found, waiting up to `wait_s` for one
    still hashing (a run shorter than the hashing of its corpus must not end 0 on a damaged corpus). Only rank 0
    hashes while the others go on into the export's collectives, so the wait is bounded: past it, one line says
    the check was not finished and how to run it."""
    while DigestWatch.started:
        watch = DigestWatch.started.pop()
        watch.wait(wait_s)
        watch.raise_if_damaged()
        if watch.running():
            print(f"dsmt: the corpus digest check had not finished {wait_s:.0f} s after the last step; the export "
                  "goes on without it (`dsmt check --deep SPEC` checks the digests)", file=sys.stderr, flush=True)
