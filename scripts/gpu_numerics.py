"""The numbers scripts/gpu_cases.py compares, and the bounds it compares them with: pure functions over metrics.jsonl
rows, per-record losses and disk sizes, unit-tested on the CPU (tests/test_gpu_cases.py).

Every bound says why it is what it is. bf16 keeps 8 significant bits: one rounding moves a value by up to
2^-9 ~ 2e-3 of itself, and two correct implementations that round in different places (a fused kernel against an
unfused one, another GEMM tiling, fp32 against bf16 softmax) drift apart by a few of those over a tiny model's
layers. A wrong mask, norm or weight layout moves the loss of a random tiny model by more than that; the fp32
comparisons (verify, LoRA against PEFT) are the sharp ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path

# --- the bounds ----------------------------------------------------------------------------------------------------

# TE layers (fused attention, fused RoPE, layer norm inside the linear) against megatron's local torch layers, both
# bf16, first step (the same weights and batch, no update yet): a few bf16 roundings apart.
TE_VS_LOCAL_REL = 2e-2
# ZeRO-2 / ZeRO-3 against ZeRO-1 at dp = 1: the same bf16 forward, gradients accumulated in fp32 in every stage
# (communication.grad_accum_dtype), the same AdamW; only how the fp32 update is flattened and partitioned differs.
ZERO_VS_ZERO1_REL = 1e-3
# fp16 (loss-scaled) against bf16, first step: fp16 keeps 11 bits, so the bf16 side's rounding dominates.
FP16_VS_BF16_REL = 2e-2
# A checkpoint written at ZeRO-1 resumed at ZeRO-3 (resharded fp32 masters and Adam moments): the steps after the
# resume as ZERO_VS_ZERO1_REL, with room for the bf16 weights re-rounded from the resharded masters.
RESHARD_REL = 5e-3
# A run resumed at its own layout: the first step after the resume is the forward of the restored weights on the
# same batch, so it is bit-exact or the restore is wrong. The later steps follow an update from the restored Adam
# moments and a backward that Transformer Engine's attention may accumulate with atomics (its default,
# NVTE_ALLOW_NONDETERMINISTIC_ALGO=1): bit-exact where the kernels are deterministic, else within this.
RESUME_LATER_REL = 1e-3
# LoRA through TE's layers against HF + PEFT on the CPU (tests/train/reference_lora.py). fp32 with TF32 off
# (NVIDIA_TF32_OVERRIDE=0): summation order only, ~1e-6 seen on CPUs, so 1e-4 leaves room for GPU reductions.
LORA_FP32_REL = 1e-4
# bf16 dsmt against the fp32 reference: bf16 rounding of the activations (loss) and of the gradients (norm).
LORA_BF16_LOSS_REL = 2e-2
LORA_BF16_GRAD_REL = 5e-2
# Packed (THD on TE) against unpacked records, bf16, per record: the mean token loss of each record.
PACKED_VS_UNPACKED_ABS = 3e-2
# toolkit.api: the same micro-batches given on the host and on the GPU (the eval step's loss): one computation.
API_HOST_VS_DEVICE_REL = 1e-6
# toolkit.api: the first train step's loss against the eval step's on the same batches (the weights before the
# update, dropout 0 in the tiny model): the same forward, another reduction of the loss sum.
API_TRAIN_VS_EVAL_REL = 1e-3


# --- comparisons ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Comparison:
    ok: bool
    worst: float  # the largest difference found (relative or absolute, as the comparison says)
    detail: str


def rel_diff(value: float, reference: float) -> float:
    """|value - reference| / |reference| (absolute below 1e-12); inf where either is not finite."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-12)


def compare_series(what: str, values: list[float], reference: list[float], *, rel: float) -> Comparison:
    """Each value within `rel` of the reference value at the same position; both series as long."""
    if len(values) != len(reference) or not values:
        return Comparison(False, math.inf, f"{what}: {len(values)} values against {len(reference)}")
    gaps = [rel_diff(v, r) for v, r in zip(values, reference)]
    worst = max(gaps)
    ok = worst <= rel
    shown = ", ".join(f"{v:.5f}/{r:.5f}" for v, r in zip(values, reference))
    return Comparison(ok, worst, f"{what} {shown}: rel {worst:.1e} {'<=' if ok else '>'} {rel:g}")


def compare_exact(what: str, values: list[float], reference: list[float]) -> Comparison:
    """Bit-for-bit equal floats (as metrics.jsonl writes them: JSON round-trips a float exactly)."""
    if len(values) != len(reference) or not values:
        return Comparison(False, math.inf, f"{what}: {len(values)} values against {len(reference)}")
    gaps = [abs(v - r) for v, r in zip(values, reference)]
    ok = all(v == r for v, r in zip(values, reference))
    first = next((i for i, (v, r) in enumerate(zip(values, reference)) if v != r), None)
    where = "bit-exact" if ok else f"first differs at position {first}: {values[first]!r} != {reference[first]!r}"
    return Comparison(ok, max(gaps), f"{what} {where} (max |diff| {max(gaps):.1e})")


def compare_resumed(what: str, values: list[float], reference: list[float]) -> Comparison:
    """The first value bit-exact, the later ones bit-exact or within RESUME_LATER_REL (see there)."""
    if len(values) != len(reference) or not values:
        return Comparison(False, math.inf, f"{what}: {len(values)} values against {len(reference)}")
    first = compare_exact(f"{what}: first", values[:1], reference[:1])
    if not first.ok:
        return first
    if values == reference:
        return Comparison(True, 0.0, f"{what} bit-exact")
    later = compare_series(f"{what}: later", values[1:], reference[1:], rel=RESUME_LATER_REL)
    return Comparison(later.ok, later.worst, f"{what}: first bit-exact, later not ({later.detail}; "
                      "TE's attention backward is not deterministic by default)")


# --- metrics.jsonl ---------------------------------------------------------------------------------------------------

def read_steps(run_dir: Path) -> list[dict]:
    """The training-step lines of a run's metrics.jsonl (validation lines carry val_loss instead of loss). A last
    line cut short is left out: the timing run may be SIGKILLed while rank 0 appends one."""
    path = Path(run_dir) / "metrics.jsonl"
    return [row for row in metrics_rows(path.read_text()) if "loss" in row]


def metrics_rows(text: str) -> list[dict]:
    """The JSON lines of a metrics.jsonl; an unparsable LAST line (a write cut short by SIGKILL) is dropped, one
    elsewhere raises."""
    lines = [line for line in text.splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return rows


def step_losses(rows: list[dict], *, steps: list[int] | None = None) -> list[float]:
    by_step = {row["step"]: row["loss"] for row in rows}
    wanted = sorted(by_step) if steps is None else steps
    missing = [step for step in wanted if step not in by_step]
    if missing:
        raise ValueError(f"metrics.jsonl has no loss for steps {missing} (has {sorted(by_step)})")
    return [by_step[step] for step in wanted]


def finite_losses(rows: list[dict], *, expected_steps: int) -> Comparison:
    losses = [row["loss"] for row in rows]
    ok = len(losses) == expected_steps and all(math.isfinite(loss) for loss in losses)
    return Comparison(ok, 0.0, f"{len(losses)}/{expected_steps} steps, losses "
                      + ", ".join(f"{loss:.4f}" for loss in losses))


def warmup_seconds(rows: list[dict]) -> tuple[float, float] | None:
    """(first step's seconds, median of the later steps): what the first step pays for compiling (megatron's
    torch.compile fusions, Triton, cuBLAS / cuDNN plans) is their difference. None without two timed steps."""
    times = [row["step_time_s"] for row in rows if row.get("step_time_s") is not None]
    if len(times) < 2:
        return None
    return times[0], statistics.median(times[1:])


def warmup_text(rows: list[dict]) -> str:
    timed = warmup_seconds(rows)
    if timed is None:
        return "step times: fewer than 2"
    first, median = timed
    return f"step 1 {first:.2f} s vs median {median:.3f} s (compile / warm-up ~{max(first - median, 0.0):.1f} s)"


# --- per-record losses (packed against unpacked rows) ---------------------------------------------------------------

def record_losses(token_loss, loss_mask, position_ids) -> list[tuple[int, float]]:
    """(counted tokens, loss sum) of every record, in row-major order. A record starts where its position id is 0
    (toolkit/data/packing.py: positions restart at each packed record; an unpacked row is one record, its padding
    after it counts nothing). Segments without a counted token (padding) are left out. Tensors [b, s]."""
    import torch

    starts = position_ids == 0
    starts[:, 0] = True
    segment = torch.cumsum(starts.to(torch.int64), dim=1) + torch.arange(len(starts))[:, None] * starts.shape[1]
    weights = loss_mask.to(torch.float64)
    flat_segment = segment.flatten()
    size = int(flat_segment.max()) + 1
    counts = torch.zeros(size, dtype=torch.float64).index_add_(0, flat_segment, weights.flatten())
    sums = torch.zeros(size, dtype=torch.float64).index_add_(0, flat_segment,
                                                               (token_loss.to(torch.float64) * weights).flatten())
    return [(int(c), float(s)) for c, s in zip(counts.tolist(), sums.tolist()) if c > 0]


def compare_records(packed: list[tuple[int, float]], unpacked: list[tuple[int, float]], *,
                    abs_tol: float) -> Comparison:
    """The same records (the same counted tokens each, in the same order: packing keeps record order) with mean
    token losses within `abs_tol` of each other."""
    if [c for c, _ in packed] != [c for c, _ in unpacked]:
        return Comparison(False, math.inf, f"records differ: {len(packed)} packed with token counts "
                          f"{[c for c, _ in packed][:8]}... against {len(unpacked)} unpacked "
                          f"{[c for c, _ in unpacked][:8]}...")
    gaps = [abs(a / c - b / c) for (c, a), (_, b) in zip(packed, unpacked)]
    worst = max(gaps)
    ok = worst <= abs_tol and all(math.isfinite(gap) for gap in gaps)
    tokens = sum(c for c, _ in packed)
    return Comparison(ok, worst, f"{len(packed)} records ({tokens} tokens): max |mean loss packed - unpacked| "
                      f"{worst:.1e} {'<=' if ok else '>'} {abs_tol:g}")


# --- the timing run's disk -----------------------------------------------------------------------------------------

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 master + Adam's two moments (toolkit/plan/checkpoint_cost.py)
EXPORT_BYTES_PER_PARAM = 2 + 4  # final-hf in bf16, final-mcore counted at fp32 to be safe
DISK_MARGIN = 1.15  # logs, metadata, the compile caches beside it
DISK_HEADROOM_BYTES = 4 * 10**9  # what the rest of the machine keeps free


@dataclasses.dataclass(frozen=True)
class DiskPlan:
    save: bool  # the run may write its checkpoint and final export
    needed_bytes: int
    free_bytes: int
    reason: str


def timing_disk_plan(*, free_bytes: int, params: int) -> DiskPlan:
    """Whether the timing run's checkpoint (saved at its last step) and final export fit in `free_bytes`. When they
    do not, the run is given spare steps and no checkpoint before its last, and SIGKILLed once its timed steps are
    logged, long before that one save (scripts/gpu_specs.py timing_spec, scripts/gpu_cases.py)."""
    needed = int((CHECKPOINT_BYTES_PER_PARAM + EXPORT_BYTES_PER_PARAM) * params * DISK_MARGIN) + DISK_HEADROOM_BYTES
    if free_bytes >= needed:
        return DiskPlan(True, needed, free_bytes, f"{free_bytes / 1e9:.1f} GB free >= {needed / 1e9:.1f} GB for the "
                        "checkpoint and export: saved, timed, then removed")
    return DiskPlan(False, needed, free_bytes, f"{free_bytes / 1e9:.1f} GB free < {needed / 1e9:.1f} GB for the "
                    "checkpoint (12 B/param) and export: the run (spare steps after the timed ones, its only save "
                    "at its last) is SIGKILLed once the timed steps are logged, nothing saved")


SAVE_LINE = re.compile(r"dsmt: checkpoint (\S+): ([\d,.]+) MB.*? in ([\d.]+) s")


def save_seconds(log_text: str) -> tuple[str, float, float] | None:
    """(tag, MB, seconds) of the last checkpoint line rank 0 printed (toolkit/train/checkpoint/checkpoints.py)."""
    found = SAVE_LINE.findall(log_text)
    if not found:
        return None
    tag, megabytes, seconds = found[-1]
    return tag, float(megabytes.replace(",", "")), float(seconds)
