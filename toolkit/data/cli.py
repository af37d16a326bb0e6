"""`dsmt data prepare INPUT... --tokenizer DIR --output PREFIX`: text corpora -> a Megatron indexed dataset.

Light to import (argparse only): the command's work, and torch / megatron / datasets, load in `run_prepare`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit.convert.cli import workers_count


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="prepare training data")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="tokenise text corpora into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx)",
        description="Tokenise INPUTs (concatenated in order) into PREFIX.bin + PREFIX.idx, megatron-core's indexed "
                    "dataset, one document per record (the tokenizer's ids + EOS), and PREFIX.dsmt.json.")
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="INPUT",
                         help="jsonl/json/csv/parquet/txt/arrow files (optionally .gz/.bz2/.xz/.zst), "
                              "datasets.save_to_disk directories or dataset repository folders")
    prepare.add_argument("--tokenizer", required=True, type=Path, metavar="DIR",
                         help="a directory AutoTokenizer.from_pretrained loads (a checkpoint's); it needs an eos_token")
    prepare.add_argument("--output", required=True, type=Path, metavar="PREFIX",
                         help="writes PREFIX.bin, PREFIX.idx and PREFIX.dsmt.json; its directory must exist")
    prepare.add_argument("--text-field", default="text", metavar="F", help="the record field holding the text")
    prepare.add_argument("--workers", type=workers_count, default=None, metavar="N",
                         help="tokenizer processes (default: min(CPUs, 4)); 1 tokenises in this process")
    prepare.add_argument("--split", default="train", metavar="S",
                         help="the split of a save_to_disk directory or repository folder (a file is this split)")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar, only the summary line")
    prepare.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from toolkit.data.prepare import prepare_corpus

    try:
        summary = prepare_corpus(inputs=args.inputs, tokenizer_dir=args.tokenizer, output_prefix=args.output,
                                 text_field=args.text_field, workers=args.workers, split=args.split,
                                 show_progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"dsmt data prepare: interrupted; temporaries removed, {args.output}.* as it was", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    print(summary.line())
    return 0
