"""Conversion cost on a generated ~1B-parameter Llama-shaped bf16 checkpoint, measured side by side in one run.

Prints: hf-to-mcore and mcore-to-hf wall time as ratios to a plain copy of the same safetensors bytes, and each
conversion's peak RSS (a fresh child process, ru_maxrss) as a ratio to the largest tensor and to the model size.

    .venv/bin/python benchmarks/convert_speed.py [--workdir DIR] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import resource  # noqa: F401  (used in the child's code string)
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def make_checkpoint(path: Path, *, num_layers: int) -> tuple[int, int]:
    """Write random bf16 tensors under Llama's HF names in 1 GiB shards; return (total bytes, largest tensor bytes)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=num_layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    path.mkdir(parents=True)
    config.save_pretrained(path)
    shard, shard_bytes, weight_map, index, total, largest = {}, 0, {}, 0, 0, 0
    generator = torch.Generator().manual_seed(0)

    def flush():
        nonlocal shard, shard_bytes, index
        index += 1
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        total, largest = total + nbytes, max(largest, nbytes)
        if shard and shard_bytes + nbytes > 2**30:
            flush()
        shard[name], shard_bytes = tensor, shard_bytes + nbytes
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, largest


def timed_child(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a fresh process running `dsmt argv` (the child reports its own ru_maxrss)."""
    code = ("import resource, sys; from toolkit.cli import main; code = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *argv], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    return wall, int(done.stdout.strip().splitlines()[-1]) * 1024


def baseline_rss() -> int:
    """Peak RSS of a process that only imports what a conversion imports (torch, megatron-core, transformers)."""
    code = ("import resource, torch, megatron.core, transformers, safetensors; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(done.stdout.strip().splitlines()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dsmt-bench-"))
    hf, mcore, back, copy = root / "hf", root / "mcore", root / "hf-back", root / "copy"
    total, largest = make_checkpoint(hf, num_layers=args.layers)
    params = total // 2
    start = time.perf_counter()
    copy.mkdir()
    for file in hf.glob("*.safetensors"):
        shutil.copyfile(file, copy / file.name)
    copy_s = time.perf_counter() - start
    to_mcore_s, to_mcore_rss = timed_child(["convert", "hf-to-mcore", str(hf), str(mcore)])
    to_hf_s, to_hf_rss = timed_child(["convert", "mcore-to-hf", str(mcore), str(back)])
    print(f"model: {params / 1e9:.2f} B params, {total / 2**30:.2f} GiB bf16, largest tensor {largest / 2**20:.0f} MiB")
    print(f"plain copy of the safetensors: {copy_s:.1f} s; imports alone: peak RSS {baseline_rss() / 2**30:.2f} GiB")
    print(f"hf-to-mcore: {to_mcore_s:.1f} s = {to_mcore_s / copy_s:.1f}x copy; peak RSS {to_mcore_rss / 2**30:.2f} GiB "
          f"= {to_mcore_rss / largest:.1f}x largest tensor = {to_mcore_rss / total:.2f}x model")
    print(f"mcore-to-hf: {to_hf_s:.1f} s = {to_hf_s / copy_s:.1f}x copy; peak RSS "
          f"{to_hf_rss / 2**30:.2f} GiB = {to_hf_rss / largest:.1f}x largest tensor = {to_hf_rss / total:.2f}x model")
    if args.workdir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
