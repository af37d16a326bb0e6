"""Time `dsmt plan`'s search for the 1T-parameter GPT of Narayanan et al. 2021 on 3,072 A100s (their Table 1 run).

Run: python benchmarks/plan_speed.py   (exits 1 if planning takes a second or more)
     python benchmarks/plan_speed.py --smoke   (the same search, no budget: that it runs; the test suite's check)
"""

from __future__ import annotations

import sys
import time

from toolkit.plan.hardware import get_gpu
from toolkit.plan.layout import Cluster, TrainingShape
from toolkit.plan.search import plan
from toolkit.adapters.model_shape import load_model_shape

BUDGET_S = 1.0


def main(argv: list[str] | None = None) -> int:
    smoke = "--smoke" in (sys.argv[1:] if argv is None else argv)
    shape = load_model_shape("gpt-1t")
    cluster = Cluster(nodes=384, gpus_per_node=8, gpu=get_gpu("a100-80gb"))
    training = TrainingShape(seq_length=2048, global_batch_size=3072)
    start = time.perf_counter()
    result = plan(shape=shape, training=training, cluster=cluster)
    elapsed_s = time.perf_counter() - start
    best = result.best
    print(f"model {shape.name} ({shape.num_params() / 1e12:.3f} T params) on {cluster.world_size} x {cluster.gpu.name},"
          f" seq {training.seq_length}, global batch {training.global_batch_size}")
    print(f"evaluated {result.evaluated} layouts ({len(result.fitting)} fit) in {elapsed_s:.3f} s "
          f"({elapsed_s / max(result.evaluated, 1) * 1e6:.0f} us per layout); budget {BUDGET_S:.1f} s")
    if best is not None:
        print(f"best: {best.layout.label()}: {best.memory.total_bytes / 1e9:.1f} GB/GPU, "
              f"step {best.time.step_time_s:.2f} s, MFU {best.time.mfu:.1%}")
    if best is None:
        print("no layout fits: the planner or its presets changed")
        return 1
    return 0 if smoke or elapsed_s < BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
