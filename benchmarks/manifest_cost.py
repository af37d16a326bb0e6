"""What a checkpoint manifest costs next to the save it follows (toolkit/train/checkpoint/manifest.py).

Writes a ~110 MB checkpoint-like tag with torch.save (float32 tensors over 8 files, shaped like DeepSpeed's two
model-state files and six ZeRO optimizer partitions), each file fsynced (a save must reach the disk), then times the
manifest of the tag (entries_for over every file + write_manifest) twice: from the page cache, as right after the
save on the node that wrote it, and cold, its pages dropped with posix_fadvise, as `dsmt checkpoint verify` reads it
a day later. Prints both against the save as ratios, and the in-memory throughput of xxh3_128 and zlib.crc32 on
the same bytes. With --repeats R every step runs R times and the median is printed.

    .venv/bin/python benchmarks/manifest_cost.py [--megabytes 110] [--repeats 3] [--workdir DIR]
    .venv/bin/python benchmarks/manifest_cost.py --smoke     # ~2 MB once: that it runs (tests do this)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

from toolkit.train.checkpoint.manifest import entries_for, list_files, write_manifest

# (file, share of the bytes): ZeRO-1 at TP=2, DP=3: bf16-sized model states are small next to fp32 master + Adam
MODEL_FILES = [f"mp_rank_0{tp}_model_states.pt" for tp in range(2)]
OPTIM_FILES = [f"zero_pp_rank_{dp}_mp_rank_0{tp}_optim_states.pt" for tp in range(2) for dp in range(3)]


def file_states(*, total_bytes: int, seed: int = 0) -> dict[str, dict]:
    """File name -> a dict of float32 tensors; the model files hold 1/12 of the bytes each, the rest split evenly."""
    generator = torch.Generator().manual_seed(seed)
    shares = {name: 1 / 12 for name in MODEL_FILES} | {name: (5 / 6) / len(OPTIM_FILES) for name in OPTIM_FILES}
    states = {}
    for name, fraction in shares.items():
        numel = int(total_bytes * fraction) // 4 // 4  # four tensors per file, 4 bytes per float32
        states[name] = {f"tensor_{i}": torch.randn(numel, generator=generator) for i in range(4)}
    return states


def timed_save(states: dict[str, dict], tag_dir: Path) -> float:
    shutil.rmtree(tag_dir, ignore_errors=True)
    os.sync()  # the previous step's dirty pages are not this save's
    started = time.perf_counter()
    tag_dir.mkdir(parents=True)
    for name, state in states.items():
        with open(tag_dir / name, "wb") as writer:
            torch.save(state, writer)
            writer.flush()
            os.fsync(writer.fileno())
    return time.perf_counter() - started


def drop_pages(tag_dir: Path) -> bool:
    """Evict the tag's (clean, fsynced) pages from the page cache; False where posix_fadvise does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in list_files(tag_dir):
        descriptor = os.open(tag_dir / name, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    return True


def timed_manifest(tag_dir: Path) -> float:
    started = time.perf_counter()
    write_manifest(tag_dir, entries_for(tag_dir, list_files(tag_dir)))
    return time.perf_counter() - started


def throughput_mb_s(blobs: list[bytes], digest, *, repeats: int) -> float:
    total = sum(len(blob) for blob in blobs)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for blob in blobs:
            digest(blob)
        seconds.append(time.perf_counter() - started)
    return total / 1e6 / statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, default=110.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="~2 MB, once: that the benchmark runs (the test "
                        "suite's check), not a measurement")
    args = parser.parse_args()
    if args.smoke:
        args.megabytes, args.repeats = 2.0, 1
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dsmt-bench-"))
    tag_dir = root / "step_000001"
    states = file_states(total_bytes=int(args.megabytes * 1e6))
    saves, warm, cold = [], [], []
    for _ in range(args.repeats):
        saves.append(timed_save(states, tag_dir))
        warm.append(timed_manifest(tag_dir))
        if drop_pages(tag_dir):
            cold.append(timed_manifest(tag_dir))
    files = list_files(tag_dir)
    total = sum((tag_dir / name).stat().st_size for name in files)
    blobs = [(tag_dir / name).read_bytes() for name in files]
    save_s, warm_s = statistics.median(saves), statistics.median(warm)
    print(f"checkpoint-like tag: {len(files)} files, {total / 1e6:.1f} MB of float32 tensors (torch.save), "
          f"{args.repeats} repeat(s), median; in {root}")
    print(f"save (torch.save + fsync)          {save_s:8.3f} s  {total / 1e6 / save_s:8.0f} MB/s")
    print(f"manifest, page cache (after save)  {warm_s:8.3f} s  {total / 1e6 / warm_s:8.0f} MB/s  "
          f"ratio manifest/save = {warm_s / save_s:.3f}")
    if cold:
        cold_s = statistics.median(cold)
        print(f"manifest, cold (pages dropped)     {cold_s:8.3f} s  {total / 1e6 / cold_s:8.0f} MB/s  "
              f"ratio manifest/save = {cold_s / save_s:.3f}")
    xxh = throughput_mb_s(blobs, lambda blob: xxhash.xxh3_128(blob).hexdigest(), repeats=max(args.repeats, 3))
    crc = throughput_mb_s(blobs, zlib.crc32, repeats=max(args.repeats, 3))
    print(f"digest throughput in memory: xxh3_128 {xxh:.0f} MB/s, zlib.crc32 {crc:.0f} MB/s "
          f"(xxh3_128/crc32 = {xxh / crc:.1f}x)")
    if args.workdir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
