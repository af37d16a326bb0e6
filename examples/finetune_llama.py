"""Fine-tune a Llama-family Hugging Face checkpoint with dsmt's Python API (`toolkit.api`).

    python examples/finetune_llama.py --model /models/Llama-3.2-1B --data my.jsonl --tp 2 --dp 2 \
        --device cuda --gpu h100-80gb --output runs/llama-ft [--lora-rank 16]

Without --model it makes a tiny random Llama (toolkit/models/tiny.py, character tokenizer) so the script runs on any
machine; without --data it trains on examples/data/tiny_stories.jsonl. The script builds the job spec as a dict,
checks it (the same rules as `dsmt check`), trains on this machine's ranks (`dsmt train`) with a validation loss on
a held-out tenth of the records, and loads the exported checkpoint back into transformers to show it is an
ordinary HF model. With --lora-rank the base weights stay frozen and only LoRA adapters train; the run also exports
them in PEFT's format (final-hf-adapter/), which this script loads onto the original checkpoint with peft.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit import api

HERE = Path(__file__).resolve().parent


def build_spec(args) -> dict:
    ranks = args.tp * args.pp * args.dp
    spec = {
        "model": {"path": str(args.model)},
        "cluster": {"nodes": 1, "gpus_per_node": ranks, "gpu": args.gpu, "device": args.device,
                    "interconnect": "tcp" if args.device == "cpu" else "nvlink"},
        "parallel": {"tp": args.tp, "pp": args.pp, "zero_stage": args.zero},
        "training": {"global_batch_size": args.micro_batch * 2 * args.dp, "micro_batch_size": args.micro_batch,
                     "seq_length": args.seq_length, "precision": "fp32" if args.device == "cpu" else "bf16",
                     "lr": args.lr, "min_lr": args.lr / 10, "warmup_steps": 1, "train_steps": args.steps,
                     "checkpoint_interval": args.steps, "log_interval": 1, "output_dir": str(args.output)},
        "data": {"path": str(args.data), "text_field": "text", "validation_fraction": args.validation_fraction},
    }
    if args.lora_rank:
        spec["training"]["lora"] = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}
    return spec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="HF checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--data", type=Path, default=HERE / "data" / "tiny_stories.jsonl")
    parser.add_argument("--output", type=Path, default=Path("runs/finetune-llama"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: full fine-tuning)")
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="share of the records held out")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpu", default="cpu", help="GPU type for the memory check (h100-80gb, a100-80gb, ...)")
    args = parser.parse_args(argv)
    if args.model is None:
        from toolkit.models.tiny import make_tiny_checkpoint

        args.model = make_tiny_checkpoint(args.output / "tiny-llama")
        print(f"no --model: a tiny random Llama in {args.model}")
    spec = api.job_spec(build_spec(args), source="finetune_llama.py")
    report = api.check(spec)
    print(report.to_text())
    if not report.ok:
        return 2
    history = api.train(spec)
    print(f"trained {len(history)} steps: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
    evaluations = api.validation_history(spec)
    print(f"validation loss {evaluations[0]['val_loss']:.4f} (step 0) -> {evaluations[-1]['val_loss']:.4f} "
          f"(step {evaluations[-1]['step']})")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.output / "final-hf")
    print(f"{args.output / 'final-hf'} loads as {type(model).__name__} "
          f"({sum(p.numel() for p in model.parameters())} parameters)")
    if args.lora_rank:
        from peft import PeftModel

        tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.model), args.output / "final-hf-adapter")
        trainable = sum(p.numel() for name, p in tuned.named_parameters() if "lora_" in name)
        print(f"{args.output / 'final-hf-adapter'} loads with peft onto {args.model} ({trainable} LoRA parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
