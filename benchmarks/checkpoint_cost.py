"""What a checkpoint save and a resume cost each rank of a training run: host memory, bytes moved, seconds.

    .venv/bin/python benchmarks/checkpoint_cost.py [--models 10M 60M] [--dp 2 4] [--async-save] [--out DIR]
    .venv/bin/python benchmarks/checkpoint_cost.py --smoke     # one tiny model at DP 2: that it runs (tests do this)

For each tiny Llama (toolkit/models/tiny.py: ~10M and ~60M parameters) and each DP size, `python -m toolkit.train`
runs on DP gloo ranks (ZeRO-1, fp32, CPU) through benchmarks/checkpoint_probe.py, which wraps
`toolkit.train.checkpoint.checkpoints.save` and `.resume`: a first launch trains 2 steps and saves after each, the
checkpoint files are then dropped from the page cache (a resume after a restart reads the disk), and a second
launch of the same spec with train_steps 3 resumes from step 2 and saves step 3. Per call and rank it prints the
peak host memory above the resident memory at the call's start (VmHWM reset just before), the ratio of that peak
to the rank's shard (fp32 master + two Adam moments of the trainable parameters / DP: 12 bytes x params / DP,
what each rank must write), the bytes written and read (/proc/self/io: wchar / rchar every write() / read(),
sockets included, so gloo's collectives over TCP count there on this CPU run; write_bytes / read_bytes what
reached the block device, nothing for a read from the page cache) and the seconds the call blocked training; then
a summary with the maximum over ranks per model and DP.

Ranks run with MALLOC_MMAP_THRESHOLD_=1 MiB: glibc's dynamic threshold would keep freed large buffers in the heap,
and the high-water mark would add up transients that a fixed threshold returns to the OS when each is freed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"
# ~10M and ~60M parameters (8 query heads, 2 KV heads, vocabulary 250: tiny.py's defaults); "smoke" for the tests
MODELS = {"10M": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=10),
          "60M": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=16),
          "smoke": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2)}
BYTES_PER_TRAINABLE = 12  # fp32 master weight + Adam's exp_avg + exp_avg_sq
FIRST_STEPS, RESUMED_STEPS = 2, 3


def write_spec(path: Path, *, model_dir: Path, output_dir: Path, dp: int, steps: int, async_save: bool) -> Path:
    import yaml

    training = {"global_batch_size": dp, "micro_batch_size": 1, "seq_length": 16, "precision": "fp32",
                "lr": 1e-4, "min_lr": 1e-4, "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                "grad_clip": 0.0, "train_steps": steps, "checkpoint_interval": 1, "keep_checkpoints": 2,
                "log_interval": 1, "seed": 7, "output_dir": str(output_dir)}
    if async_save:  # a field of the new checkpoint code's spec: the old one refuses it by name
        training["async_save"] = True
    spec = {"model": {"path": str(model_dir)},
            "cluster": {"nodes": 1, "gpus_per_node": dp, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "parallel": {"tp": 1, "pp": 1, "zero_stage": 1}, "training": training,
            "data": {"path": str(STORIES), "shuffle": True}}
    path.write_text(yaml.safe_dump(spec))
    return path


def parameter_count(model_dir: Path) -> int:
    """The HF checkpoint's parameters (all of them train here); megatron pads the vocabulary a little more."""
    from safetensors import safe_open

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():
                shape = weights.get_slice(name).get_shape()
                total += math.prod(shape)
    return total


def launch(spec: Path, *, dp: int, probe_dir: Path, log_dir: Path) -> float:
    """The probe on `dp` ranks; returns the launch's seconds."""
    from toolkit.launch.local import launch_local_workers

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "DSMT_CHECKPOINT_PROBE": str(probe_dir)}
    started = time.perf_counter()
    launch_local_workers(module="benchmarks.checkpoint_probe", nprocs=dp, log_dir=log_dir, timeout_s=1800,
                         env=env, args=["--config", str(spec), "--continue-with-changes"])
    return time.perf_counter() - started


def drop_page_cache(folder: Path) -> None:
    """Write the folder's dirty pages out, then evict its files' pages, so that a resume reads the disk."""
    os.sync()
    for file in (path for path in folder.rglob("*") if path.is_file()):
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def run_case(*, model_dir: Path, dp: int, root: Path, async_save: bool) -> dict[int, list[dict]]:
    """Both launches of one (model, DP) case; rank -> its recorded calls."""
    probe_dir, output_dir = root / "probe", root / "out"
    probe_dir.mkdir(parents=True)
    for index, steps in enumerate((FIRST_STEPS, RESUMED_STEPS)):
        spec = write_spec(root / f"job{index}.yaml", model_dir=model_dir, output_dir=output_dir, dp=dp,
                          steps=steps, async_save=async_save)
        if index:
            drop_page_cache(output_dir / "checkpoints")
        seconds = launch(spec, dp=dp, probe_dir=probe_dir, log_dir=root / f"logs{index}")
        print(f"  launch {index} ({steps} train_steps): {seconds:.0f} s", flush=True)
    ranks = {}
    for path in probe_dir.glob("rank*.json"):
        events = json.loads(path.read_text())["events"]
        # a fresh start's resume finds nothing (step 0): not a resume
        ranks[int(path.stem.removeprefix("rank"))] = [e for e in events if e["kind"] == "save" or e["step"]]
    if sorted(ranks) != list(range(dp)):
        raise RuntimeError(f"expected the probe's JSON of ranks 0..{dp - 1} in {probe_dir}, found {sorted(ranks)}")
    return ranks


MB = 1e6
COLUMNS = ("peak MB", "peak/shard", "kept MB", "wchar MB", "write_bytes MB", "rchar MB", "read_bytes MB", "blocked s",
           "done s")


def figures(event: dict, *, shard_bytes: float) -> list[float | None]:
    """The table's columns of one call; `done s` only for a save (blocked + the wait of a background one)."""
    return [event["peak_above_baseline"] / MB, event["peak_above_baseline"] / shard_bytes,
            event.get("kept_after", 0) / MB, event["wchar"] / MB, event["write_bytes"] / MB, event["rchar"] / MB, event["read_bytes"] / MB,
            event["blocked_s"], event.get("completed_s")]


def format_row(label: str, rank: str, values: list[float | None]) -> str:
    cells = ["-" if value is None else f"{value:.3f}" if index >= 7 else f"{value:.2f}" if index == 1
             else f"{value:.1f}" for index, value in enumerate(values)]
    return f"  {label:<17}{rank:>5}" + "".join(f"{cell:>{len(name) + 2}}" for cell, name in zip(cells, COLUMNS))


def max_over_ranks(rows: list[list[float | None]]) -> list[float | None]:
    return [None if column[0] is None else max(column) for column in zip(*rows)]


def case_table(name: str, *, params: int, dp: int, ranks: dict[int, list[dict]]) -> tuple[str, dict]:
    """The per-call, per-rank table of one case and its maxima over ranks (call label -> figures)."""
    shard_bytes = BYTES_PER_TRAINABLE * params / dp
    lines = [f"\nmodel {name}: {params / 1e6:.2f}M parameters, DP {dp}, ZeRO-1, fp32; shard = 12 B x params / DP "
             f"= {shard_bytes / MB:.1f} MB", f"  {'call':<17}{'rank':>5}" + "".join(f"{c:>{len(c) + 2}}"
                                                                             for c in COLUMNS)]
    maxima = {}
    for index, first in enumerate(ranks[0]):
        label = f"{first['kind']} step {first['step']}"
        per_rank = [figures(ranks[rank][index], shard_bytes=shard_bytes) for rank in sorted(ranks)]
        maxima[label] = max_over_ranks(per_rank)
        lines.append(format_row(label, "max", maxima[label]))
        lines.extend(format_row("", str(rank), values) for rank, values in zip(sorted(ranks), per_rank))
    return "\n".join(lines), {"shard_mb": shard_bytes / MB, "calls": maxima}


def summary_table(cases: list[tuple[str, int, dict]]) -> str:
    """One line per case and call: the maxima over ranks."""
    lines = ["\nsummary: maximum over ranks (peak = host memory above the call's starting RSS; kept = what stays "
             "resident after it: a resume's Adam moments, which every run holds after its first step; shard = 12 B x "
             "params / DP; wchar / rchar count sockets too: gloo's collectives)", f"  {'model':<7}{'DP':>3}{'shard MB':>10}  {'call':<16}" + "".join(
                 f"{c:>{len(c) + 2}}" for c in COLUMNS)]
    for name, dp, table in cases:
        for label, values in table["calls"].items():
            row = format_row(label, "", values)[2 + 17 + 5:]
            lines.append(f"  {name:<7}{dp:>3}{table['shard_mb']:>10.1f}  {label:<16}{row}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=[m for m in MODELS if m != "smoke"], default=["10M", "60M"])
    parser.add_argument("--dp", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--async-save", action="store_true", help="training.async_save: true (the new checkpoint "
                        "code only); each background save is waited for at once so its memory peak is its own")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs, logs and per-rank JSON here")
    parser.add_argument("--smoke", action="store_true", help="one tiny model at DP 2: that the benchmark runs (the "
                        "test suite's check), not a measurement")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.dp = ["smoke"], [2]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))  # DeepSpeed's JIT op cache
    from toolkit.models.tiny import make_tiny_checkpoint

    print(f"toolkit: {sys.modules['toolkit'].__file__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dsmt-ckpt-cost-") as scratch:
        root = args.out or Path(scratch)
        cases = []
        for name in args.models:
            model_dir = make_tiny_checkpoint(root / name / "model", seed=3, **MODELS[name])
            params = parameter_count(model_dir)
            for dp in args.dp:
                print(f"model {name} ({params / 1e6:.2f}M parameters), DP {dp}", flush=True)
                ranks = run_case(model_dir=model_dir, dp=dp, root=root / name / f"dp{dp}",
                                 async_save=args.async_save)
                text, table = case_table(name, params=params, dp=dp, ranks=ranks)
                print(text, flush=True)
                cases.append((name, dp, table))
    print(summary_table(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
