"""`dsmt demo`: dsmt end to end on a tiny Llama it builds (no download; 2 CPU cores are enough).

build an HF checkpoint -> convert to a layout-free megatron checkpoint -> verify logits at TP2 x PP2 from both
the HF and the megatron checkpoint -> export back to HF and check the round trip is bit-exact -> fine-tune with
`dsmt train` at PP2 x DP2 ZeRO-1 (4 processes) on examples/data/tiny_stories.jsonl -> generate a few tokens from
the fine-tuned export with transformers."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="convert, verify, fine-tune and export a tiny Llama on this machine")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the files here (default: a temp dir)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.set_defaults(func=run)


def run(args) -> int:
    import os

    # The demo is a CPU run (gloo, 4 ranks, tiny model). On a GPU machine its CPU spec would be refused
    # (cluster.device=cpu with CUDA visible), so hide the GPUs from this process and its ranks; CUDA reads the
    # variable when it is first used, which nothing has done yet.
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        print("dsmt demo runs on the CPU: CUDA_VISIBLE_DEVICES='' for this run", flush=True)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="dsmt-demo-") as scratch:
            return run_demo(workdir=Path(scratch), tp=args.tp, pp=args.pp, train_steps=args.train_steps)
    return run_demo(workdir=args.workdir, tp=args.tp, pp=args.pp, train_steps=args.train_steps)


def _step(message: str) -> float:
    print(f"\n== {message}", flush=True)
    return time.perf_counter()


STORIES = Path(__file__).resolve().parents[1] / "examples" / "data" / "tiny_stories.jsonl"


def demo_spec(*, model_dir: Path, output_dir: Path, train_steps: int) -> dict:
    """The demo's job spec: 4 CPU ranks, pipeline 2 x data-parallel 2, ZeRO-1, fp32."""
    return {
        "model": {"path": str(model_dir)},
        "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
        "parallel": {"tp": 1, "pp": 2, "zero_stage": 1},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64, "precision": "fp32",
                     "lr": 3e-3, "min_lr": 3e-4, "lr_schedule": "cosine", "warmup_steps": 2, "weight_decay": 0.0,
                     "train_steps": train_steps, "checkpoint_interval": train_steps, "log_interval": 5,
                     "output_dir": str(output_dir)},
        "data": {"path": str(STORIES)},
    }


def run_demo(*, workdir: Path, tp: int, pp: int, train_steps: int = 40) -> int:
    import torch

    from toolkit.convert.hf_to_mcore import convert_hf_to_mcore
    from toolkit.convert.mcore_to_hf import convert_mcore_to_hf
    from toolkit.tiny import make_tiny_checkpoint
    from toolkit.verify.run import run_verify_many

    hf_dir, mcore_dir, export_dir = workdir / "tiny-llama-hf", workdir / "tiny-llama-mcore", workdir / "tiny-llama-export"
    start = _step(f"building a tiny random Llama (GQA 8/2 heads, vocab 250) in {hf_dir}")
    make_tiny_checkpoint(hf_dir)
    _step("dsmt convert hf-to-mcore")
    print(convert_hf_to_mcore(hf_dir=hf_dir, out_dir=mcore_dir, overwrite=True, show_progress=False).line())
    _step(f"dsmt verify at tp={tp} pp={pp} ({tp * pp} processes), HF checkpoint and megatron checkpoint")
    results = run_verify_many(checkpoints=[hf_dir, mcore_dir], tp=tp, pp=pp)
    for result in results:
        print(f"  {result['checkpoint_kind']:5s} max|Δlogits|={result['max_abs_diff']:.2e} "
              f"KL={result['kl_divergence']:.2e} {'PASS' if result['passed'] else 'FAIL'}")
    _step("dsmt convert mcore-to-hf")
    print(convert_mcore_to_hf(mcore_dir=mcore_dir, out_dir=export_dir, overwrite=True).line())
    exact = _round_trip_exact(hf_dir, export_dir)
    print(f"  round trip bit-exact: {exact}")
    history = _fine_tune(workdir=workdir, model_dir=hf_dir, train_steps=train_steps)
    trained_dir = workdir / "train" / "final-hf"
    _step(f"generating from the fine-tuned export {trained_dir} with transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(trained_dir), AutoTokenizer.from_pretrained(trained_dir)
    prompt = tokenizer("the cat", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print(f"  {tokenizer.decode(generated[0])!r} (a 50k-parameter character model after {train_steps} steps)")
    learned = history[-1]["loss"] < history[0]["loss"]
    print(f"  loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} ({'down' if learned else 'NOT down'})")
    ok = exact and learned and all(r["passed"] for r in results)
    print(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return 0 if ok and torch.isfinite(generated.float()).all() else 1


def _fine_tune(*, workdir: Path, model_dir: Path, train_steps: int) -> list[dict]:
    import json

    import yaml

    from toolkit.cli import main as dsmt

    spec_path = workdir / "demo-job.yaml"
    spec_path.write_text(yaml.safe_dump(demo_spec(model_dir=model_dir, output_dir=workdir / "train", train_steps=train_steps)))
    _step(f"dsmt train --config {spec_path}  (pp=2 dp=2 ZeRO-1, 4 processes, {train_steps} steps)")
    if dsmt(["train", "--config", str(spec_path)]) != 0:
        raise SystemExit(1)
    metrics = (workdir / "train" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in metrics]


def _round_trip_exact(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(left) == sorted(right) and all(torch.equal(left[k], right[k]) for k in left)
