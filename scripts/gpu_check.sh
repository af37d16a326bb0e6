#!/usr/bin/env bash
# The GPU path in one run of at most 8 minutes on one H100 / H200: versions, then scripts/gpu_cases.py (the paths
# no CPU test runs, checked for right numbers: verify of every GPU-specific family under Transformer Engine, TE
# against local layers, packed against unpacked records, LoRA against PEFT, ZeRO-2 / ZeRO-3 / fp16 against ZeRO-1
# bf16, a bit-exact resume and a ZeRO-1 -> ZeRO-3 reshard, toolkit.api with CUDA batches; one line per case as it
# ends, each case in its own process group killed on its own timeout), ending with 20 bf16 `dsmt train` steps of
# the llama3.2-1b shape alone on the GPU; then its measured step time, MFU and peak memory beside the planner's
# prediction for that layout.
#
#   bash scripts/gpu_check.sh [WORK_DIR]          # default WORK_DIR: a new directory under /tmp
#   bash scripts/gpu_check.sh --report RUN_DIR    # only the measured-vs-planned table of a finished run (CPU too)
#
# Environment: PYTHON (default .venv/bin/python), GPU_CHECK_BUDGET_S (default 390 s, counted from this script's
# start: no case starts that would end after it, a case still running 45 s after it is killed, and each case's own
# timeout stops one that hangs before then; with the table that follows, the whole script ends within 8 minutes,
# well inside a device command's 10), GPU_CHECK_JOBS (default 3 cases at once on the GPU).
set -uo pipefail  # no -e: a failed case is reported, the table still printed and the large files still removed

STARTED=$(date +%s)  # the budget's start: the versions block and the cases' inputs count against it
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-.venv/bin/python}
BUDGET_S=${GPU_CHECK_BUDGET_S:-390}
JOBS=${GPU_CHECK_JOBS:-3}

# Measured (metrics.jsonl) vs planned (toolkit.plan, the same layout the run used) for RUN_DIR.
report() {
  "$PY" - "$1" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, "scripts")
from gpu_numerics import metrics_rows  # a last line cut short by a SIGKILL is dropped
from toolkit.plan.search import evaluate
from toolkit.plan.layout import Cluster
from toolkit.plan.timing import training_flops
from toolkit.check.checks import planner_inputs  # the spec -> planner mapping `dsmt check` uses
from toolkit.spec.load import load_spec, model_shape

run_dir = Path(sys.argv[1])
spec = load_spec(run_dir / "resolved" / "job.resolved.yaml")
rows = [row for row in metrics_rows((run_dir / "metrics.jsonl").read_text()) if "step_time_s" in row]
if not rows:
    sys.exit(f"{run_dir}/metrics.jsonl has no steps")
shape = model_shape(spec.model)
layout, training, gpu, assumptions = planner_inputs(spec)
cluster = Cluster(nodes=spec.cluster.nodes, gpus_per_node=spec.cluster.gpus_per_node, gpu=gpu)
planned = evaluate(shape=shape, layout=layout, training=training, cluster=cluster, assumptions=assumptions)

# The first steps pay for allocator growth and kernel selection: time the rest (at least half of the run).
warmup = min(5, len(rows) // 2)
step_time_s = statistics.median(row["step_time_s"] for row in rows[warmup:])
tokens = training.global_batch_size * training.seq_length
model_flops = training_flops(shape=shape, tokens=tokens, seq_length=training.seq_length, recompute="none", tp=layout.tp)
mfu = model_flops / (step_time_s * cluster.world_size * gpu.peak_bf16_tflops * 1e12)  # the planner's definition
memory = [row["memory_gib"] for row in rows if row.get("memory_gib") is not None]
peak_gb = max(memory) * 2**30 / 1e9 if memory else float("nan")

print(f"{shape.name} on {cluster.world_size} x {gpu.name}: {layout.label()}, {training.global_batch_size} x "
      f"{training.seq_length} tokens per step, median of steps {warmup + 1}..{len(rows)}")
print(f"{'':26}{'measured':>12}{'planned':>12}")
print(f"{'step time (s)':26}{step_time_s:12.3f}{planned.time.step_time_s:12.3f}")
print(f"{'tokens/s':26}{tokens / step_time_s:12,.0f}{planned.time.tokens_per_s:12,.0f}")
print(f"{'MFU':26}{mfu:12.1%}{planned.time.mfu:12.1%}")
print(f"{'peak memory (GB, rank 0)':26}{peak_gb:12.1f}{planned.memory.total_bytes / 1e9:12.1f}")
print("  (measured memory: torch.cuda.max_memory_allocated; planned: the worst stage's total with "
      f"{assumptions.framework_overhead_gb} GB for CUDA context / NCCL and allocator slack)")
print(json.dumps({"measured": {"step_time_s": step_time_s, "mfu": mfu, "peak_memory_gb": peak_gb},
                  "planned": {"step_time_s": planned.time.step_time_s, "mfu": planned.time.mfu,
                              "memory_gb": planned.memory.total_bytes / 1e9}}))
EOF
}

if [[ "${1:-}" == "--report" ]]; then
  report "${2:?usage: gpu_check.sh --report RUN_DIR}"
  exit
fi

WORK=${1:-$(mktemp -d /tmp/dsmt-gpu-check.XXXXXX)}
mkdir -p "$WORK"
RUN="$WORK/train-1b"
# The timing run's checkpoint and export (~20 GB on a 64 GiB disk) are removed however this script ends; its
# metrics and resolved spec stay for --report. The tiny cases' files (a few MB) stay beside their logs.
cleanup() {
  rm -rf "$RUN/checkpoints" "$RUN/final-mcore" "$RUN/final-hf"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== versions (work dir $WORK)"
"$PY" --version
"$PY" - <<'EOF'
import importlib.metadata as md

import torch

print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
for dist in ("deepspeed", "megatron-core", "transformers", "peft", "transformer-engine", "transformer_engine"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        if dist != "transformer_engine":
            print(f"{dist}: not installed")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not available"
df -h "$WORK" | tail -n 1

echo "== cases: one line each as it ends (logs in $WORK/logs)"
# The runner kills each case's process group on the case's own timeout, cut to 45 s past the budget's end, and
# starts none that would end after the budget; this outer bound only catches a runner that hangs itself: it ends
# past the moment every case must have been stopped (that end, then a SIGTERM's grace), so it exceeds every
# case's timeout as the runner applies it, and leaves the table and the cleanup time inside the device's limit.
# --foreground: Ctrl-C reaches the runner, which then stops the running cases (they are in sessions of their own).
OUTER_S=$("$PY" scripts/gpu_cases.py --outer-timeout --budget-s "$BUDGET_S" --started-at "$STARTED")
[[ "$OUTER_S" =~ ^[0-9]+$ ]] || OUTER_S=$((BUDGET_S + 75))  # the same bound, counted from now
STATUS=0
timeout --foreground --kill-after=15 "$OUTER_S" "$PY" scripts/gpu_cases.py "$WORK" --with-timing --jobs "$JOBS" \
  --budget-s "$BUDGET_S" --started-at "$STARTED" || STATUS=1

echo "== measured vs planned: llama3.2-1b, 1 GPU"
if [[ -s "$RUN/metrics.jsonl" ]]; then
  report "$RUN" || STATUS=1
else
  echo "no timing run to report ($RUN/metrics.jsonl is missing: see the timing-1b line above)"
fi
if [[ "$STATUS" != 0 ]]; then
  echo "gpu_check: FAILED: a case above says FAIL, or the table could not be made ($WORK; $(($(date +%s) - STARTED)) s)"
  exit 1
fi
echo "gpu_check: OK ($WORK; $(($(date +%s) - STARTED)) s)"
