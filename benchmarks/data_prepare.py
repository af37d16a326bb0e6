"""`dsmt data prepare` throughput against the tokenizer alone, side by side in one run on one generated corpus.

For each tokenizer (the dsmt tiny character tokenizer, and a byte-level BPE trained here on the corpus with the
`tokenizers` library; nothing is downloaded) it prints tokens/s of:
  (a) the tokenizer alone: `tokenizer(batch)["input_ids"]` over batches of 1,000 texts held in memory, one process,
      nothing written (the tokenizer's own Rust thread pool on, its default);
  (b) `dsmt data prepare --workers 1` and (c) `--workers 2` on the same texts as a jsonl file, from its summary
      (imports excluded; tokenizer load, pool start, reading, writing .bin/.idx and renames included);
and `ratio prepare/tokenizer = X.XX` per workers value. The prepare runs are `prepare_corpus` in this process, the
function behind the command (its pool forks from here).

    .venv/bin/python benchmarks/data_prepare.py [--docs 20000] [--workers 1 2] [--workdir DIR]
    .venv/bin/python benchmarks/data_prepare.py --smoke     # a few hundred documents: that it runs (tests do this)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import tempfile
import time
from pathlib import Path

# set, so that forking the pool after (a) used the Rust thread pool does not print tokenizers' warning; the workers
# turn it off for themselves (toolkit/data/prepare.py)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's bar; read when the hub is imported

from toolkit.data.prepare import prepare_corpus  # noqa: E402
from toolkit.models.tiny import make_tiny_checkpoint  # noqa: E402

BATCH_TEXTS = 1000


def generate_texts(*, num_docs: int, seed: int) -> list[str]:
    """Documents of 10-90 words drawn Zipf-like from 5,000 random lowercase words, some capitalised, with
    punctuation: about 300 characters each."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    weights = [1 / rank for rank in range(1, len(words) + 1)]
    texts = []
    for _ in range(num_docs):
        chosen = rng.choices(words, weights=weights, k=rng.randint(10, 90))
        chosen[0] = chosen[0].capitalize()
        texts.append(" ".join(chosen) + rng.choice(".!?"))
    return texts


def train_bpe(*, texts: list[str], directory: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(directory)
    return directory


def tokenizer_alone(*, tokenizer_dir: Path, texts: list[str]) -> tuple[int, float]:
    """(tokens, seconds) of batched tokenizer calls; tokens count the EOS prepare appends, so the two agree."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    started = time.perf_counter()
    tokens = 0
    for first in range(0, len(texts), BATCH_TEXTS):
        for ids in tokenizer(texts[first:first + BATCH_TEXTS])["input_ids"]:
            tokens += len(ids) + (not ids or ids[-1] != eos)
    return tokens, time.perf_counter() - started


def compare(*, name: str, tokenizer_dir: Path, texts: list[str], corpus: Path, workers_list: list[int],
            root: Path) -> None:
    tokens, seconds = tokenizer_alone(tokenizer_dir=tokenizer_dir, texts=texts)
    alone = tokens / seconds
    print(f"{name}:")
    print(f"  {'tokenizer alone (batched, 1 process)':40s} {alone:12,.0f} tokens/s  ({seconds:.2f} s, "
          f"{tokens:,} tokens)")
    outputs, ratios = [], []
    for workers in workers_list:
        prefix = root / f"{name}-w{workers}"
        summary = prepare_corpus(inputs=[corpus], tokenizer_dir=tokenizer_dir, output_prefix=prefix,
                                 workers=workers, show_progress=False)
        rate = summary.counts.num_tokens / summary.seconds
        same = "" if summary.counts.num_tokens == tokens else f"  TOKEN COUNT DIFFERS: {summary.counts.num_tokens:,}"
        print(f"  {f'dsmt data prepare --workers {workers}':40s} {rate:12,.0f} tokens/s  ({summary.seconds:.2f} s, "
              f"{summary.counts.num_documents:,} documents, {summary.num_bytes / 1e6:.1f} MB){same}")
        outputs.append(b"".join(Path(f"{prefix}{suffix}").read_bytes() for suffix in (".bin", ".idx")))
        ratios.append((workers, rate / alone))
    for workers, ratio in ratios:
        print(f"  ratio prepare/tokenizer = {ratio:.2f}  (--workers {workers})")
    print(f"  outputs byte-identical across --workers: {'yes' if len(set(outputs)) == 1 else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="300 documents: that the benchmark runs (the test "
                        "suite's check), not a measurement")
    args = parser.parse_args()
    if args.smoke:
        args.docs, args.bpe_vocab = 300, 512
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dsmt-bench-data-"))
    root.mkdir(parents=True, exist_ok=True)
    texts = generate_texts(num_docs=args.docs, seed=0)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizers = {"tiny-char": make_tiny_checkpoint(root / "tiny")}
    started = time.perf_counter()
    tokenizers[f"bpe-{args.bpe_vocab}"] = train_bpe(texts=texts, directory=root / "bpe", vocab_size=args.bpe_vocab)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, "
          f"{corpus.stat().st_size / 1e6:.1f} MB jsonl; {cpus} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"BPE trained in {time.perf_counter() - started:.1f} s")
    for name, directory in tokenizers.items():
        compare(name=name, tokenizer_dir=directory, texts=texts, corpus=corpus, workers_list=args.workers, root=root)
    if args.workdir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
