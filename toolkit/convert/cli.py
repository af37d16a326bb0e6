"""`dsmt convert hf-to-mcore SRC DST`, `dsmt convert mcore-to-hf SRC DST` and
`dsmt convert merge-lora BASE ADAPTER OUT`."""

from __future__ import annotations

import argparse
from pathlib import Path


def workers_count(text: str) -> int:
    """`--workers N` of the commands that run work in parallel (dsmt convert, dsmt data prepare): a whole number
    >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--workers must be a whole number >= 1, got {text!r}")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="convert between HF and dsmt megatron checkpoints")
    directions = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = directions.add_parser("hf-to-mcore", help="HF checkpoint -> layout-free megatron checkpoint")
    to_mcore.add_argument("source", type=Path)
    to_mcore.add_argument("target", type=Path)
    to_mcore.add_argument("--overwrite", action="store_true", help="replace an existing target directory")
    to_mcore.add_argument("--vocab-pad-multiple", type=int, default=128,
                          help="pad the vocabulary to a multiple of this (megatron's make_vocab_size_divisible_by)")
    to_mcore.add_argument("--dequantize-fp8", action="store_true",
                          help="read a block-scaled FP8 checkpoint (DeepSeek-V3's quantization_config with "
                               "weight_block_size and *_scale_inv tensors) as bf16; the output is a bf16 checkpoint")
    to_mcore.add_argument("--dequantize-mxfp4", action="store_true",
                          help="read an MXFP4 checkpoint (GPT-OSS as published: quant_method mxfp4, *_blocks and "
                               "*_scales expert tensors) as bf16; the output is a bf16 checkpoint")
    _common_flags(to_mcore)
    to_mcore.set_defaults(func=run_hf_to_mcore)
    to_hf = directions.add_parser("mcore-to-hf", help="dsmt megatron checkpoint -> HF checkpoint")
    to_hf.add_argument("source", type=Path)
    to_hf.add_argument("target", type=Path)
    to_hf.add_argument("--overwrite", action="store_true", help="replace an existing target directory")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")
    _common_flags(to_hf)
    to_hf.set_defaults(func=run_mcore_to_hf)
    merge = directions.add_parser("merge-lora", help="merge a PEFT LoRA adapter into its HF base checkpoint")
    merge.add_argument("base", type=Path, help="the HF checkpoint the adapter was trained on")
    merge.add_argument("adapter", type=Path, help="the adapter folder (adapter_config.json, adapter_model.safetensors)")
    merge.add_argument("out", type=Path, help="the merged HF checkpoint to write")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing target directory")
    merge.add_argument("--quiet", action="store_true", help="no progress lines, only the summary line")
    merge.set_defaults(func=run_merge_lora)


def _common_flags(parser) -> None:
    parser.add_argument("--workers", type=workers_count, default=1,
                        help="tensors read and written in parallel (threads); memory grows by one tensor per worker")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, only the summary line")


def run_hf_to_mcore(args) -> int:
    from toolkit.convert.hf_to_mcore import convert_hf_to_mcore

    summary = convert_hf_to_mcore(hf_dir=args.source, out_dir=args.target, overwrite=args.overwrite,
                                  vocab_pad_multiple=args.vocab_pad_multiple, workers=args.workers,
                                  show_progress=not args.quiet, dequantize_fp8=args.dequantize_fp8,
                                  dequantize_mxfp4=args.dequantize_mxfp4)
    print(summary.line())
    return 0


def run_mcore_to_hf(args) -> int:
    from toolkit.convert.mcore_to_hf import convert_mcore_to_hf

    summary = convert_mcore_to_hf(mcore_dir=args.source, out_dir=args.target, overwrite=args.overwrite,
                                  max_shard_bytes=int(args.max_shard_gb * 2**30), workers=args.workers,
                                  show_progress=not args.quiet)
    print(summary.line())
    return 0


def run_merge_lora(args) -> int:
    from toolkit.convert.merge_lora import merge_lora

    summary = merge_lora(base_dir=args.base, adapter_dir=args.adapter, out_dir=args.out, overwrite=args.overwrite,
                         show_progress=not args.quiet)
    print(summary.line())
    return 0
