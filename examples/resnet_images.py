"""Train an image classifier (a Hugging Face ResNet) on a folder of images with DeepSpeed ZeRO data parallelism:
the PyTorch DistributedDataParallel example, done with dsmt.

    python examples/resnet_images.py --data images/ --model resnet-ckpt/ --output runs/resnet --steps 20

`--data` holds one sub-folder per class (`images/cat/*.png`, `images/dog/*.png`, ...; `datasets`' imagefolder
layout) or a `datasets.save_to_disk` directory with an image and a `label` column. `--model` is a directory
written by `save_pretrained` of a `*ForImageClassification` model whose num_labels covers the classes. The
checkpoint's image processor is used when it has a preprocessor_config.json, else dsmt's stated default (RGB,
bilinear resize to config.image_size or 224, ImageNet mean/std). With `--make-tiny`, a missing `--data` or
`--model` is created: three classes of coloured 16x16 PNGs and a tiny random ResNet, so the script runs anywhere.

ResNet has no megatron-core adapter, so dsmt trains it data-parallel only: `--ranks` processes on this machine
(`dsmt train`'s local launcher), gradients averaged as DDP does, optimizer states partitioned by ZeRO `--zero`.
BatchNorm statistics are per rank, as in DDP; `--sync-batchnorm` (GPU only) makes them global.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit import api


def build_spec(args) -> dict:
    global_batch = args.micro_batch * args.grad_accum * args.ranks
    return {
        "model": {"path": str(args.model)},
        "cluster": {"nodes": 1, "gpus_per_node": args.ranks, "gpu": args.gpu, "device": args.device,
                    "interconnect": "tcp" if args.device == "cpu" else "nvlink"},
        "parallel": {"tp": 1, "pp": 1, "zero_stage": args.zero},
        "training": {"global_batch_size": global_batch, "micro_batch_size": args.micro_batch,
                     "precision": "fp32" if args.device == "cpu" else "bf16", "lr": args.lr, "min_lr": args.lr,
                     "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.01, "grad_clip": 1.0,
                     "train_steps": args.steps, "checkpoint_interval": args.steps, "log_interval": 1,
                     "sync_batchnorm": args.sync_batchnorm, "output_dir": str(args.output)},
        "data": {"path": str(args.data)},
    }


def make_tiny_images(root: Path, *, classes=("red", "green", "blue"), per_class: int = 8) -> None:
    """Coloured 16x16 PNGs with noise, one sub-folder per class: a task a tiny ResNet learns in a few steps."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.full((16, 16, 3), 60.0)
            pixels[..., label % 3] = 200
            noisy = np.clip(pixels + rng.normal(0, 40, pixels.shape), 0, 255).astype(np.uint8)
            Image.fromarray(noisy).save(root / name / f"{i:03d}.png")


def make_tiny_resnet(path: Path, *, num_labels: int) -> None:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=num_labels, image_size=32)
    ResNetForImageClassification(config).save_pretrained(path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="image folder (one sub-folder per class)")
    parser.add_argument("--model", type=Path, required=True, help="*ForImageClassification checkpoint directory")
    parser.add_argument("--output", type=Path, required=True, help="run directory (metrics, checkpoints, final-hf)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel processes on this machine")
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sync-batchnorm", action="store_true", help="SyncBatchNorm (GPU only)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpu", default="cpu", help="GPU type for the memory check (h100-80gb, ...)")
    parser.add_argument("--make-tiny", action="store_true", help="create a missing --data / --model (tiny, random)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.make_tiny and not args.data.exists():
        make_tiny_images(args.data)
        print(f"--make-tiny: three classes of 16x16 PNGs in {args.data}")
    if args.make_tiny and not args.model.exists():
        make_tiny_resnet(args.model, num_labels=len([p for p in args.data.iterdir() if p.is_dir()]))
        print(f"--make-tiny: a tiny random ResNet in {args.model}")
    spec = api.job_spec(build_spec(args), source="resnet_images.py")
    report = api.check(spec)
    print(report.to_text())
    if not report.ok:
        return 2
    history = api.train(spec)
    print(f"trained {len(history)} steps at DP{args.ranks} ZeRO-{args.zero}: loss {history[0]['loss']:.4f} -> "
          f"{history[-1]['loss']:.4f}; model in {args.output / 'final-hf'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
