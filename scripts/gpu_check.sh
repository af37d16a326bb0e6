#!/usr/bin/env bash
# The GPU path in one short run (under 8 minutes on one H100/H200): versions, the paths no CPU test runs
# (scripts/gpu_cases.py: verify under Transformer Engine, bf16 with packing, LoRA on TE layers for Llama and
# GPT-2, a plain model, MoE with its aux loss; TP2 x PP2 verify too on 4+ GPUs), then 20 bf16 `dsmt train` steps of the llama3.2-1b shape (1.24B parameters, synthetic tokens,
# megatron init) with the measured step time, MFU and peak memory beside the planner's prediction for that layout.
#
#   bash scripts/gpu_check.sh [WORK_DIR]          # default WORK_DIR: a new directory under /tmp
#   bash scripts/gpu_check.sh --report RUN_DIR    # only the measured-vs-planned table of a finished run (CPU too)
#
# Environment: PYTHON (default .venv/bin/python), GPU_CHECK_STEPS (default 20).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
STEPS=${GPU_CHECK_STEPS:-20}

# Measured (metrics.jsonl) vs planned (toolkit.plan, the same layout the run used) for RUN_DIR.
report() {
  "$PY" - "$1" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

from toolkit.plan.search import evaluate
from toolkit.plan.layout import Cluster
from toolkit.plan.timing import training_flops
from toolkit.check.checks import planner_inputs  # the spec -> planner mapping `dsmt check` uses
from toolkit.spec.load import load_spec, model_shape

run_dir = Path(sys.argv[1])
spec = load_spec(run_dir / "resolved" / "job.resolved.yaml")
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
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
  exit 0
fi

WORK=${1:-$(mktemp -d /tmp/dsmt-gpu-check.XXXXXX)}
mkdir -p "$WORK"
echo "== versions (work dir $WORK)"
"$PY" --version
"$PY" - <<'EOF'
import importlib.metadata as md

import torch

print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"CUDA available: {torch.cuda.is_available()}, GPUs: {torch.cuda.device_count()}")
for dist in ("deepspeed", "megatron-core", "transformers", "transformer-engine", "transformer_engine"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        if dist != "transformer_engine":
            print(f"{dist}: not installed")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "== GPU paths: verify under TE, bf16 + packing, LoRA (Llama, GPT-2), a plain model, MoE aux loss"
# One PASS / FAIL line per case (scripts/gpu_cases.py); a failure is reported at the end, after the timing run.
CASES_OK=1
timeout 420 "$PY" scripts/gpu_cases.py "$WORK/cases" || CASES_OK=0

echo "== dsmt train, $STEPS bf16 steps of llama3.2-1b on synthetic tokens, 1 GPU"
# The planner's preset for this GPU: its peak FLOPs are the MFU denominator.
GPU_PRESET=$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); n = p.name.upper(); \
print('h200-141gb' if 'H200' in n else 'h100-80gb' if 'H100' in n else \
'a100-80gb' if 'A100' in n and p.total_memory > 50e9 else 'a100-40gb' if 'A100' in n else 'h100-80gb')")
echo "planner preset: $GPU_PRESET"
RUN="$WORK/train-1b"
cat > "$WORK/job.yaml" <<EOF
model: {builtin: llama3.2-1b}
cluster: {nodes: 1, gpus_per_node: 1, gpu: $GPU_PRESET, device: cuda}
parallel: {tp: 1, pp: 1, zero_stage: 1}
training:
  precision: bf16
  seq_length: 2048
  micro_batch_size: 4
  global_batch_size: 8
  train_steps: $STEPS
  warmup_steps: 2
  checkpoint_interval: $STEPS
  log_interval: 5
  output_dir: $RUN
# Synthetic tokens need no tokenizer (data.tokenizer is only read for text data), so nothing is downloaded.
data: {synthetic: true}
EOF
timeout 360 "$PY" -m toolkit.cli train --config "$WORK/job.yaml"

echo "== measured vs planned"
report "$RUN"
# The 1B run's optimizer checkpoint and exports are ~20 GB: keep only the metrics and the resolved spec.
rm -rf "$RUN/checkpoints" "$RUN/final-mcore" "$RUN/final-hf"
if [[ "$CASES_OK" == 0 ]]; then
  echo "gpu_check: FAILED: a GPU path above says FAIL ($WORK)"
  exit 1
fi
echo "gpu_check: OK ($WORK)"
