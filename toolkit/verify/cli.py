"""`dsmt verify CHECKPOINT --tp N --pp M`: exit 0 only when max |Δlogits| is within tolerance (decoders: next-token
logits; encoders: MLM logits, or a sequence classifier's outputs)."""

from __future__ import annotations

import json
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("verify", help="compare HF and sharded megatron-core logits")
    parser.add_argument("checkpoint", type=Path, help="HF checkpoint directory or dsmt megatron checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=1, help="virtual (interleaved) stages per pipeline rank")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; ep data-parallel ranks)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max |Δlogit| allowed (default 1e-4: verify runs both models in fp32 with TF32 off, "
                        "Transformer Engine's GEMMs included)")
    parser.add_argument("--reference", type=Path, default=None,
                        help="HF checkpoint to compare a megatron checkpoint with (default: the one it came from)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--verbose", action="store_true", help="every rank's output and the libraries' warnings "
                        "on the console (default: rank 0 speaks)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from toolkit.verify.run import run_verify

    result = run_verify(checkpoint=args.checkpoint, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                        batch_size=args.batch_size,
                        seq_len=args.seq_len, tolerance=args.tolerance, reference=args.reference)
    if args.json:
        print(json.dumps(result))
    else:
        verdict = "PASS" if result["passed"] else "FAIL"
        print(f"{verdict}: {result['model_type']} {result['task']} tp={result['tp']} pp={result['pp']} "
              f"vpp={result['vpp']} ep={result['ep']} max|Δlogits|={result['max_abs_diff']:.3e} KL={result['kl_divergence']:.3e} "
              f"(tolerance {result['tolerance']:.1e}, {result['tokens']} tokens; {result['math']}, "
              f"{result['layers']} layers)" + (f"; {result['window']}" if result.get("window") else ""))
    return 0 if result["passed"] else 1
