"""Megatron indexed corpora as training rows: megatron-core's `GPTDataset` (one corpus, `data.format: megatron`)
and `BlendedDataset` (`data.blend`), built by its `BlendedMegatronDatasetBuilder`.

* A corpus is `PREFIX.bin` + `PREFIX.idx` (`dsmt data prepare`, or Megatron's preprocess_data.py with
  `--append-eod`): documents of token ids, each ending with the end-of-document id (EOD).
* Samples are `seq_length + 1` consecutive tokens of the shuffled documents (megatron-core's sample index, seeded
  with `training.seed`); a sample may cut a document and hold several.
* Document boundaries: per-document attention, as dsmt packs records. megatron-core's `reset_position_ids`
  restarts the positions after every EOD, and dsmt's model turns a position 0 after column 0 into a
  block-diagonal causal mask (toolkit/adapters/packed.py); `eod_mask_loss` masks the label read at an EOD, the one
  that would predict the next document from this one. The EOD itself is a label (the model learns to end
  documents). `reset_attention_mask` stays off: the positions carry the boundaries, no s x s mask is stored.
* Split: `data.validation_fraction = f` is Megatron's `--split (1-f),f,0`: the last share of each corpus's
  documents is validation, read once per evaluation; the training side draws `train_steps x global batch`
  samples (more epochs when the corpus is smaller).
* The index files megatron-core builds (document / sample / shuffle indices, the blend's) are cached under
  `<data.cache_dir or OUTPUT/data-cache>/megatron` (a shared filesystem, as for checkpoints). Global rank 0 builds
  them (minutes on a large corpus) while the other ranks wait on a status file beside them with rank 0's heartbeat
  (toolkit/launch/rank0.py), not in megatron-core's barrier, which would time out after the process group's
  collective timeout (`training.collective_timeout_s`); then every rank runs megatron-core's build, which reads them.
* Every rank checks each corpus's files before megatron-core reads them (toolkit/data/corpus_check.py: the .idx
  against itself, the .bin's size and the sidecar's record), and global rank 0 compares their digests with the
  sidecar's in a background thread while training starts: damage found fails the run at rank 0's next read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.data.corpus_check import CorpusDamaged, DigestWatch, check_corpus
from toolkit.data.examples import count_loss_tokens
from toolkit.data.validation import TRAIN, VALIDATION
from toolkit.errors import DsmtError
from toolkit.spec.data_schema import DataSpec, megatron_corpora

SCAN_CHUNK_TOKENS = 1 << 26  # tokens per numpy max() while scanning a corpus without dsmt's sidecar


class CorpusError(DsmtError):
    """A corpus that cannot be read, or cannot train this model; `rule` names why."""

    def __init__(self, rule: str, message: str):
        self.rule = rule
        super().__init__(f"{rule}: {message}")


@dataclass(frozen=True)
class Corpus:
    """What the trainer must know of one corpus before it reads it."""

    prefix: str
    eod_id: int
    max_token_id: int
    num_documents: int
    num_tokens: int
    tokenizer_identity: str | None  # None: not prepared by dsmt (no sidecar)


def read_corpus(prefix: str, *, eod_fallback: int | None) -> Corpus:
    """The corpus at `prefix`, checked whole (`check_corpus`: CorpusDamaged); its EOD and largest id from dsmt's
    sidecar (`dsmt data prepare`), else `eod_fallback` (the model tokenizer's EOS) and a scan of the `.bin`."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from toolkit.data.prepare import missing_corpus_files, read_sidecar

    base = Path(prefix).expanduser()
    missing = missing_corpus_files(base)
    if missing:
        raise CorpusError("megatron_corpus_missing", f"data.format=megatron corpus {prefix!r} lacks "
                          f"{', '.join(missing)}; give the PREFIX of PREFIX.bin / PREFIX.idx (`dsmt data prepare "
                          f"INPUT --tokenizer DIR --output PREFIX` writes them)")
    try:
        sidecar = read_sidecar(str(base))
    except DsmtError as err:  # not JSON, another format, keys missing: the message says which and the fix
        raise CorpusError("megatron_sidecar", str(err)) from err
    facts = check_corpus(base, sidecar=sidecar)
    try:
        dataset = IndexedDataset(str(base))
    except Exception as err:  # what check_corpus does not look at (the multimodal flag, a file that vanished)
        raise CorpusError("megatron_corpus_damaged", f"{prefix!r} cannot be read by megatron-core's "
                          f"IndexedDataset ({type(err).__name__}: {err}); prepare it again") from err
    counts = dict(num_documents=facts.num_sequences, num_tokens=facts.num_tokens)
    if sidecar is not None:
        return Corpus(prefix=str(base), eod_id=int(sidecar["eod_id"]), max_token_id=int(sidecar["max_token_id"]),
                      tokenizer_identity=sidecar.get("tokenizer_identity"), **counts)
    if eod_fallback is None:
        raise CorpusError("megatron_eod", f"{prefix!r} has no dsmt sidecar ({base}.dsmt.json) saying its "
                          "end-of-document id, and the model's tokenizer has no eos_token; prepare it with "
                          "`dsmt data prepare`")
    return Corpus(prefix=str(base), eod_id=eod_fallback, max_token_id=_scan_max(str(base) + ".bin", dataset),
                  tokenizer_identity=None, **counts)


def _scan_max(bin_path: str, dataset) -> int:
    tokens = np.memmap(bin_path, dtype=dataset.index.dtype, mode="r")
    return max(int(tokens[i:i + SCAN_CHUNK_TOKENS].max()) for i in range(0, len(tokens), SCAN_CHUNK_TOKENS))


def corpus_fit_problems(*, corpus: Corpus, vocab_size: int, tokenizer,
                        tokenizer_identity: str) -> list[CorpusError]:
    """Why the corpus cannot train this model: ids past the vocabulary, another tokenizer's EOD or ids."""
    found = []
    if corpus.max_token_id >= vocab_size:
        found.append(CorpusError("token_ids_vocab", f"corpus {corpus.prefix} holds token id {corpus.max_token_id} "
                                 f"but the model's vocab_size is {vocab_size}; prepare it with the model's tokenizer"))
    if tokenizer.eos_token_id is not None and corpus.eod_id != tokenizer.eos_token_id:
        found.append(CorpusError("megatron_eod", f"corpus {corpus.prefix} ends documents with id {corpus.eod_id}, "
                                 f"the model's tokenizer with eos id {tokenizer.eos_token_id}; prepare it with the "
                                 f"model's tokenizer"))
    if corpus.tokenizer_identity is not None and corpus.tokenizer_identity != tokenizer_identity:
        found.append(CorpusError("megatron_tokenizer", f"corpus {corpus.prefix} was prepared with another tokenizer "
                                 f"than the model's (their vocabularies or rules differ); prepare it again with "
                                 f"--tokenizer set to the model's directory, or set data.tokenizer to the one it was "
                                 f"prepared with"))
    return found


def corpus_problems(*, data: DataSpec, tokenizer, vocab_size: int) -> tuple[list[Corpus], list[DsmtError]]:
    """Every corpus of `data` read and fitted to the model: (the corpora read, every problem found)."""
    from toolkit.data.tokenize import tokenizer_identity

    identity = tokenizer_identity(tokenizer)
    corpora, problems = [], []
    for _, prefix in megatron_corpora(data):
        try:
            corpus = read_corpus(prefix, eod_fallback=tokenizer.eos_token_id)
        except (CorpusError, CorpusDamaged) as err:
            problems.append(err)
            continue
        corpora.append(corpus)
        problems += corpus_fit_problems(corpus=corpus, vocab_size=vocab_size, tokenizer=tokenizer,
                                        tokenizer_identity=identity)
    return corpora, problems


def check_corpora(*, data: DataSpec, tokenizer, vocab_size: int) -> list[Corpus]:
    """`corpus_problems`, raising one error that lists every problem."""
    corpora, problems = corpus_problems(data=data, tokenizer=tokenizer, vocab_size=vocab_size)
    if len(problems) == 1:
        raise problems[0]  # its own rule and fix, as it was raised
    if problems:
        raise DsmtError("; ".join(map(str, problems)))
    return corpora


class _TokenizerView:
    """The part of a Megatron tokenizer GPTDataset reads: EOD, the vocabulary size, an identity for its cache
    hash; no `pad` (megatron-core then pads with -1, an id no corpus holds)."""

    def __init__(self, *, eod: int, vocab_size: int, identity: str):
        self.eod = eod
        self.vocab_size = vocab_size
        self.unique_identifiers = {"class": "dsmt", "eod": eod, "vocab_size": vocab_size, "tokenizer": identity}


def split_string(data: DataSpec) -> str:
    """Megatron's `--split` for `data.validation_fraction`: "train,valid,test" weights."""
    fraction = data.validation_fraction or 0.0
    return f"{1 - fraction},{fraction},0"


def megatron_rows(*, data: DataSpec, model_path: str | None, part: str, num_samples: int | None, seq_length: int,
                  vocab_size: int, seed: int, cache_root: Path) -> MegatronRows:
    """The samples of `part` ("train": `num_samples` of them; "validation": the held-out documents once).
    Collective when torch.distributed is initialised (`build_datasets`: rank 0 builds the index caches first)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from toolkit.data.tokenize import load_tokenizer, tokenizer_identity

    if part == TRAIN and num_samples is None:
        raise DsmtError("megatron_rows: the training side needs num_samples (train_steps x global batch)")
    if part == VALIDATION and data.validation_fraction is None:
        raise DsmtError("there is no validation data: set data.validation_fraction (Megatron's split)")
    tokenizer = load_tokenizer(data=data, model_path=model_path)
    corpora = check_corpora(data=data, tokenizer=tokenizer, vocab_size=vocab_size)
    watch = digest_watch(corpora) if part == TRAIN else None  # hashing overlaps megatron-core's index build
    weights = [weight for weight, _ in megatron_corpora(data)] if data.blend is not None else None
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, split=split_string(data), path_to_cache=str(cache_root),
        blend=([corpus.prefix for corpus in corpora], weights if part == TRAIN else None),
        tokenizer=_TokenizerView(eod=corpora[0].eod_id, vocab_size=vocab_size, identity=tokenizer_identity(tokenizer)),
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True, create_attention_mask=False,
        add_extra_token_to_sequence=True)
    sizes = [num_samples, 0, 0] if part == TRAIN else [0, None, None]
    Path(cache_root).mkdir(parents=True, exist_ok=True)
    built = build_datasets(config=config, sizes=sizes, cache_root=Path(cache_root), part=part)
    dataset = built[0 if part == TRAIN else 1]
    if dataset is None or len(dataset) == 0:
        documents = sum(corpus.num_documents for corpus in corpora)
        raise DsmtError(f"megatron_split_empty: the {part} side of {', '.join(c.prefix for c in corpora)} "
                        f"({documents} documents, split {split_string(data)}) holds no sample of seq_length + 1 = "
                        f"{seq_length + 1} tokens; adjust data.validation_fraction or give a larger corpus")
    return MegatronRows(dataset=dataset, seq_length=seq_length, digest_watch=watch)


def build_datasets(*, config, sizes: list, cache_root: Path, part: str) -> list:
    """megatron-core's datasets (one or None per split) on every rank. With a process group, global rank 0 first
    builds the index caches while the others wait on a status file in `cache_root` (`on_rank0`: a failure raises on
    every rank, a silent rank 0 too); megatron-core's own build then finds the caches on every rank, so that its
    barriers last as long as loading them."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from toolkit.launch.rank0 import on_rank0

    if not dist.is_initialized():  # no other rank to wait: megatron-core builds and reads in one go
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    status_file = _status_file(cache_root)
    on_rank0(lambda progress: _build_index_caches(config=config, sizes=sizes, cache_root=cache_root,
                                                  progress=progress),
             what=f"building megatron-core's {part} index caches in {cache_root}", status_file=status_file)
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    dist.barrier()  # every rank has read the status file (short: every rank has just read the caches)
    if dist.get_rank() == 0:
        status_file.unlink(missing_ok=True)
    return built


def _status_file(cache_root: Path) -> Path:
    """This build's status file, named by rank 0 for every rank: two jobs sharing data.cache_dir that build at the
    same time must not overwrite each other's status."""
    import torch.distributed as dist

    name = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return cache_root / f".dsmt-index-build-{name[0]}.status.json"


def _build_index_caches(*, config, sizes: list, cache_root: Path, progress) -> None:
    """On rank 0 alone: megatron-core's build without its barriers (`_rank0_builder`), which writes the caches.
    An OSError (the cache directory, the corpus files) becomes a CorpusError naming what to fix."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    progress(f"building the index caches of {', '.join(config.blend[0])}")
    try:
        _rank0_builder()(GPTDataset, sizes, lambda: True, config).build()
    except Exception as err:
        cause = err if isinstance(err, OSError) else err.__cause__  # megatron-core wraps an OSError in Exception
        if not isinstance(cause, OSError):
            raise
        raise CorpusError("megatron_index_cache", f"megatron-core could not build the index caches of "
                          f"{', '.join(config.blend[0])} in {cache_root} ({type(cause).__name__}: {cause}); make "
                          f"data.cache_dir (default OUTPUT/data-cache) writable with free space, and check that the "
                          f"corpus files are readable (prepare them again if damaged)") from err


def _rank0_builder():
    """megatron-core's BlendedMegatronDatasetBuilder without its barriers, for rank 0 alone: the other ranks are not
    in the builder, so a barrier would hold rank 0 until the collective timeout. `build_generic_dataset` takes a
    `synchronize_ranks` flag, given False; the blend's per-corpus step has none and always synchronises, so it is
    done here as megatron-core does it with its default single builder thread, through the per-corpus build with
    synchronize_ranks=False. The datasets, hence the cache files, are the plain builder's. Private methods:
    megatron-core is pinned <0.17 (pyproject.toml), and tests/data/test_data_cache.py's 2-rank launch fails
    if a barrier comes back here."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import Split

    class Rank0Builder(BlendedMegatronDatasetBuilder):
        @staticmethod
        def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
            return BlendedMegatronDatasetBuilder.build_generic_dataset(cls, is_built_on_rank, False, *args)

        def _build_megatron_datasets_parallel(self, prefixes, split, sizes_per_dataset):
            built = [[] for _ in Split]
            for prefix, sizes in zip(prefixes, sizes_per_dataset):
                for index, dataset in enumerate(self._build_megatron_dataset_splits(prefix, split, sizes, False)):
                    built[index].append(dataset)
            return built

    return Rank0Builder


def digest_watch(corpora: list[Corpus]) -> DigestWatch | None:
    """On global rank 0 (or without a process group), the digests of `corpora` checked in the background; the
    other ranks read the same files and are stopped by the launcher when rank 0 fails."""
    import torch.distributed as dist

    from toolkit.data.prepare import read_sidecar

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    recorded = [(corpus.prefix, read_sidecar(corpus.prefix)) for corpus in corpora]
    if not any(sidecar and sidecar.get("files") for _, sidecar in recorded):
        return None  # no digests recorded (corpora not made by dsmt, or prepared before it recorded them)
    return DigestWatch(corpora=recorded)


class MegatronRows:
    """A megatron-core dataset as dsmt rows (toolkit/data/examples.py's interface), read sample by sample.
    `digest_watch`: the background digest check of its corpora, whose damage fails the next read."""

    kind = "megatron"

    def __init__(self, *, dataset, seq_length: int, digest_watch: DigestWatch | None = None):
        self.dataset = dataset
        self._seq_length = seq_length
        self.digest_watch = digest_watch

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def seq_length(self) -> int:
        return self._seq_length

    def rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.digest_watch is not None:
            self.digest_watch.raise_if_damaged()
        samples = [self.dataset[int(row)] for row in rows]
        token_ids = torch.stack([torch.cat([s["tokens"], s["labels"][-1:]]) for s in samples]).to(torch.int64)
        loss_mask = torch.stack([s["loss_mask"] for s in samples]).to(torch.float32)
        position_ids = torch.stack([s["position_ids"] for s in samples]).to(torch.int64)
        return token_ids, loss_mask, position_ids

    def counted_tokens(self) -> int:
        return count_loss_tokens(self, chunk_rows=256)  # a sample at a time through GPTDataset

    def describe(self) -> str:
        return f"{len(self)} megatron samples of {self._seq_length + 1} ids"
