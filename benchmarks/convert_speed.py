"""Conversion speed and memory on a generated ~1.1 B-parameter Llama-shaped bf16 checkpoint, side by side in one run.

For each direction (and each --workers value) it prints: the conversion's own time (the summary line's, imports
excluded) and the process's wall time, both as ratios to a plain copy of the same bytes measured in the same run;
throughput in GB/s; peak RSS (the child's VmHWM) above the import baseline as a ratio to the largest tensor.
Every timed step starts after `sync`, so no step pays for the previous one's dirty pages; with --repeats R each
step runs R times, interleaved, and the median is printed.

    .venv/bin/python benchmarks/convert_speed.py [--layers 16] [--workers 1 2] [--repeats 3] [--workdir DIR]
    .venv/bin/python benchmarks/convert_speed.py --smoke     # a tiny model once: that it runs (tests do this)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# convert_measure.py beside this file, whether it runs as a script or as `-m benchmarks.convert_speed`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert_measure import import_baseline_rss, run_dsmt, write_random_checkpoint  # noqa: E402


def timed_copy(source: Path, target: Path, *, in_kernel: bool) -> float:
    """shutil.copyfile (the kernel copies, copy_file_range / sendfile), or read + write through a 16 MiB buffer in
    this process, as any converter must move the bytes."""
    shutil.rmtree(target, ignore_errors=True)
    os.sync()
    started = time.perf_counter()
    target.mkdir()
    for file in sorted(source.glob("*.safetensors")):
        if in_kernel:
            shutil.copyfile(file, target / file.name)
        else:
            with open(file, "rb") as reader, open(target / file.name, "wb") as writer:
                while chunk := reader.read(16 * 2**20):
                    writer.write(chunk)
    return time.perf_counter() - started


def timed_convert(argv: list[str], target: Path) -> tuple[float, float, int]:
    """(conversion seconds from its summary line, process wall seconds, peak RSS bytes)."""
    shutil.rmtree(target, ignore_errors=True)
    os.sync()
    run = run_dsmt(argv)
    if run.returncode != 0:
        raise SystemExit(f"dsmt {' '.join(argv)} failed:\n{run.output}")
    seconds = float(re.search(r", ([\d.]+) s \(", run.output).group(1))
    return seconds, run.seconds, run.peak_rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="a 1-layer, hidden-256 model, once, 1 worker: that "
                        "the benchmark runs (the test suite's check), not a measurement")
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dsmt-bench-"))
    hf = root / "hf"
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1024) if args.smoke else {}
    if args.smoke:
        args.layers, args.workers, args.repeats = 1, [1], 1
    total, largest = write_random_checkpoint(hf, num_layers=args.layers, **shape)
    baseline = 0 if args.smoke else import_baseline_rss()  # a process of its own: seconds the smoke run skips
    rows: dict[str, list[tuple[float, float, int]]] = {}
    copies, user_copies = [], []
    for _ in range(args.repeats):
        copies.append(timed_copy(hf, root / "copy", in_kernel=True))
        user_copies.append(timed_copy(hf, root / "copy", in_kernel=False))
        for workers in args.workers:
            mcore, back = root / f"mcore-w{workers}", root / f"hf-w{workers}"
            flags = ["--quiet", "--workers", str(workers)]
            rows.setdefault(f"hf-to-mcore --workers {workers}", []).append(
                timed_convert(["convert", "hf-to-mcore", str(hf), str(mcore), *flags], mcore))
            rows.setdefault(f"mcore-to-hf --workers {workers}", []).append(
                timed_convert(["convert", "mcore-to-hf", str(mcore), str(back), *flags], back))
    copy_s = statistics.median(copies)
    print(f"model: {total / 2 // 1e6 / 1e3:.2f} B params, {total / 2**30:.2f} GiB bf16, largest tensor "
          f"{largest / 2**20:.0f} MiB; imports alone: "
          + ("not measured (--smoke)" if args.smoke else f"{baseline / 2**30:.2f} GiB RSS"))
    print(f"plain copy of the safetensors: {copy_s:.1f} s ({total / 1e9 / copy_s:.2f} GB/s), median of "
          f"{args.repeats}: {', '.join(f'{c:.1f}' for c in copies)} s (the ratios below are to this)")
    user_s = statistics.median(user_copies)
    print(f"read + write copy in Python: {user_s:.1f} s ({total / 1e9 / user_s:.2f} GB/s), "
          f"{', '.join(f'{c:.1f}' for c in user_copies)} s")
    print(f"{'step':28s} {'convert s':>9s} {'/copy':>6s} {'GB/s':>6s} {'wall s':>7s} {'/copy':>6s} "
          f"{'peak RSS GiB':>12s} {'above imports / largest':>24s}")
    for name, runs in rows.items():
        seconds = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        peak = max(r[2] for r in runs)
        print(f"{name:28s} {seconds:9.1f} {seconds / copy_s:6.2f} {total / 1e9 / seconds:6.2f} {wall:7.1f} "
              f"{wall / copy_s:6.2f} {peak / 2**30:12.2f} {(peak - baseline) / largest:24.2f}")
    if args.workdir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
