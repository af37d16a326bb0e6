"""`dsmt demo`: the adapters end to end on a tiny Llama it builds (no download, CPU is enough).

build an HF checkpoint -> convert to a layout-free megatron checkpoint -> verify logits at TP2 x PP2 from both
the HF and the megatron checkpoint -> export back to HF -> check the round trip is bit-exact -> generate a few
tokens from the export with transformers. (Fine-tuning joins the demo when `dsmt train` lands.)"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="convert + verify + export a tiny Llama on this machine")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the files here (default: a temp dir)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="dsmt-demo-") as scratch:
            return run_demo(workdir=Path(scratch), tp=args.tp, pp=args.pp)
    return run_demo(workdir=args.workdir, tp=args.tp, pp=args.pp)


def _step(message: str) -> float:
    print(f"\n== {message}", flush=True)
    return time.perf_counter()


def run_demo(*, workdir: Path, tp: int, pp: int) -> int:
    import torch

    from toolkit.convert.hf_to_mcore import convert_hf_to_mcore
    from toolkit.convert.mcore_to_hf import convert_mcore_to_hf
    from toolkit.tiny import make_tiny_checkpoint
    from toolkit.verify.run import run_verify_many

    hf_dir, mcore_dir, export_dir = workdir / "tiny-llama-hf", workdir / "tiny-llama-mcore", workdir / "tiny-llama-export"
    start = _step(f"building a tiny random Llama (GQA 8/2 heads, vocab 250) in {hf_dir}")
    make_tiny_checkpoint(hf_dir)
    _step("dsmt convert hf-to-mcore")
    print(convert_hf_to_mcore(hf_dir=hf_dir, out_dir=mcore_dir, overwrite=True))
    _step(f"dsmt verify at tp={tp} pp={pp} ({tp * pp} processes), HF checkpoint and megatron checkpoint")
    results = run_verify_many(checkpoints=[hf_dir, mcore_dir], tp=tp, pp=pp)
    for result in results:
        print(f"  {result['checkpoint_kind']:5s} max|Δlogits|={result['max_abs_diff']:.2e} "
              f"KL={result['kl_divergence']:.2e} {'PASS' if result['passed'] else 'FAIL'}")
    _step("dsmt convert mcore-to-hf")
    print(convert_mcore_to_hf(mcore_dir=mcore_dir, out_dir=export_dir, overwrite=True))
    exact = _round_trip_exact(hf_dir, export_dir)
    print(f"  round trip bit-exact: {exact}")
    _step("generating from the export with transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(export_dir), AutoTokenizer.from_pretrained(export_dir)
    prompt = tokenizer("hello", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print(f"  {tokenizer.decode(generated[0])!r} (random weights: the text is noise, the pipeline is the point)")
    ok = exact and all(r["passed"] for r in results)
    print(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok and torch.isfinite(generated.float()).all() else 1


def _round_trip_exact(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(left) == sorted(right) and all(torch.equal(left[k], right[k]) for k in left)
