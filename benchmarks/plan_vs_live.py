"""The planner's memory model against live engines on this CPU: model states per rank and activations per case.

Run: python benchmarks/plan_vs_live.py [--out DIR]   (2 launches, 2 and 4 gloo processes; ~2-4 min on 2 cores)
     python benchmarks/plan_vs_live.py --smoke       (one small launch; the test suite's check)

Prints, per layout, ZeRO stage, precision and rank, the parameter / gradient / optimizer / buffer bytes DeepSpeed
holds (tests/plan/live_tensors.py classifies every tensor) next to the planner's prediction for that rank, then
the activation cases (stored layer bytes and the step's live-bytes peak of megatron-core's forward + loss +
backward). Exits 1 when a model-state category is off by more than 5 % on any rank (tests/plan/test_live_engine.py
and tests/plan/test_measured.py hold the same bounds).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "plan"))

from live_memory import (LAUNCHES, SMOKE_LAUNCHES, activation_rows, format_activation_table,  # noqa: E402
                         format_state_table, run_launch, state_rows)

TOLERANCE = 0.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the per-rank JSON here (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="one small launch (2 processes, bf16 ZeRO-1 and 3, one "
                        "activation case per recompute kind): that the benchmark runs (the test suite's check; "
                        "tests/plan/test_live_engine.py checks every case)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))  # DeepSpeed's JIT op cache
    from toolkit.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as scratch:
        root = args.out or Path(scratch)
        model_dir = make_tiny_checkpoint(root / "llama")
        launches = []
        for index, (processes, cases) in enumerate(SMOKE_LAUNCHES if args.smoke else LAUNCHES):
            start = time.perf_counter()
            launches.append(run_launch(model_dir=model_dir, out_dir=root / f"launch{index}", processes=processes,
                                       cases=cases))
            print(f"launch {index}: {processes} processes, {time.perf_counter() - start:.0f} s", flush=True)
    states = [row for ranks in launches for row in state_rows(ranks)]
    activations = [row for ranks in launches for row in activation_rows(ranks)]
    print("\nmodel states per rank (tiny Llama: hidden 64, 4 layers, 8 / 2 heads, vocab 256; * = ZeRO-3 "
          "persistence threshold 100k)\n" + format_state_table(states))
    print("\nactivations (local attention and layers; peak over forward, loss and backward)\n"
          + format_activation_table([row for row in activations if row["rank"] == 0]))
    worst = {category: max(abs(row[category][2]) for row in states) for category in
             ("parameters", "gradients", "optimizer")}
    print("\nlargest |deviation| over every rank: " + ", ".join(f"{k} {v:.2%}" for k, v in worst.items())
          + f"; activations: stored layers {max(abs(r['layers'][2]) for r in activations):.2%}, step peak "
          + ", ".join(f"{kind} {min(r['peak'][2] for r in activations if r['recompute'] == kind):+.2%}.."
                      f"{max(r['peak'][2] for r in activations if r['recompute'] == kind):+.2%}"
                      for kind in ("none", "selective", "full")))
    return 0 if max(worst.values()) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
