"""Fine-tune BERT with a regression head (one output, mean squared error) with tensor and data parallelism: the
Colossal-AI hybrid-parallel BERT example, done with dsmt (megatron-core layers inside DeepSpeed).

    python examples/bert_regression.py --model bert-reg/ --data scores.jsonl --output runs/bert --steps 50

`--model` is a directory written by `save_pretrained` of a `BertForSequenceClassification` with num_labels=1
(from a pretrained BERT: `BertForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=1)`, then
`save_pretrained` with its tokenizer). `--data` is a jsonl (or csv / parquet / save_to_disk) with a text field and
a number per record (`--text-field`, `--label-field`). Each text is tokenised with the checkpoint's tokenizer,
truncated and padded to `--seq-length`; the loss is the mean squared error over the global batch.

The layout is `--tp` tensor-parallel ranks (the attention heads and MLP split across them) times `--dp` data-parallel
replicas (ZeRO `--zero` partitions the optimizer states over them), all on this machine (`dsmt train`'s local
launcher). The trained model is exported to OUTPUT/final-hf, which loads with AutoModelForSequenceClassification.
With `--make-tiny`, a missing `--model` is created: a tiny random BERT with a character WordPiece tokenizer, so the
script runs anywhere (examples/data/tiny_scores.jsonl is a matching data set: short stories and a score).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit import api

REPO = Path(__file__).resolve().parents[1]


def build_spec(args) -> dict:
    ranks = args.tp * args.dp
    global_batch = args.micro_batch * args.grad_accum * args.dp
    return {
        "model": {"path": str(args.model)},
        "cluster": {"nodes": 1, "gpus_per_node": ranks, "gpu": args.gpu, "device": args.device,
                    "interconnect": "tcp" if args.device == "cpu" else "nvlink"},
        "parallel": {"tp": args.tp, "pp": 1, "zero_stage": args.zero},
        "training": {"global_batch_size": global_batch, "micro_batch_size": args.micro_batch,
                     "seq_length": args.seq_length, "precision": "fp32" if args.device == "cpu" else "bf16",
                     "lr": args.lr, "min_lr": args.lr / 10, "lr_schedule": "cosine", "warmup_steps": 0,
                     "weight_decay": 0.01, "grad_clip": 1.0, "train_steps": args.steps,
                     "checkpoint_interval": args.steps, "log_interval": 1, "attention": "local",
                     "output_dir": str(args.output)},
        "data": {"path": str(args.data), "text_field": args.text_field, "label_field": args.label_field},
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="BertForSequenceClassification (num_labels=1) dir")
    parser.add_argument("--data", type=Path, default=REPO / "examples" / "data" / "tiny_scores.jsonl",
                        help="records with a text and a number (default: the tiny example data)")
    parser.add_argument("--output", type=Path, required=True, help="run directory (metrics, checkpoints, final-hf)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--label-field", default="label")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpu", default="cpu", help="GPU type for the memory check (h100-80gb, ...)")
    parser.add_argument("--make-tiny", action="store_true", help="create a missing --model (tiny, random)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.make_tiny and not args.model.exists():
        from toolkit.demo.tiny_encoder import make_tiny_bert

        make_tiny_bert(args.model, architecture="BertForSequenceClassification", num_labels=1)
        print(f"--make-tiny: a tiny random BERT regression model in {args.model}")
    spec = api.job_spec(build_spec(args), source="bert_regression.py")
    report = api.check(spec)
    print(report.to_text())
    if not report.ok:
        return 2
    history = api.train(spec)
    print(f"trained {len(history)} steps at TP{args.tp} x DP{args.dp} ZeRO-{args.zero}: MSE {history[0]['loss']:.4f} "
          f"-> {history[-1]['loss']:.4f}; model in {args.output / 'final-hf'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
