"""GPU presets: the few numbers the planner needs per accelerator, with their public sources.

Bandwidths are per GPU and per direction, the figure a ring collective is bounded by (nccl-tests PERFORMANCE.md:
"bus bandwidth" compares to the hardware's per-direction link speed). NVLink totals in data sheets are
bidirectional: A100 600 GB/s total -> 300 GB/s each way; H100/H200 900 GB/s -> 450 GB/s. InfiniBand is one
NIC per GPU (rail-optimised DGX / HGX nodes): HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s per direction.
Memory is what the device reports (nvidia-smi MiB), not the marketing figure.
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_bf16_tflops: float     # dense tensor-core peak, no sparsity
    memory_bytes: int           # device memory as reported by the driver
    hbm_gbps: float             # device memory bandwidth, GB/s (optimizer step is memory bound)
    nvlink_gbps: float          # intra-node, per GPU per direction, GB/s
    ib_gbps: float              # inter-node, per GPU per direction, GB/s
    # Achieved / peak throughput of the layers' matmuls: the time model's one fitted constant per GPU, the
    # least-squares fit (log space) to the measured runs on it (toolkit/plan/published.py; tests/plan/
    # test_calibration.py checks it is the fit).
    matmul_efficiency: float

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / 1e9


GPU_PRESETS: dict[str, GpuSpec] = {
    # A100 SXM data sheet: 312 TF bf16 dense, 1,555 / 2,039 GB/s HBM, NVLink 3 600 GB/s total; HDR InfiniBand.
    "a100-40gb": GpuSpec("a100-40gb", 312.0, 40_960 * MIB, 1555.0, 300.0, 25.0, 0.70),
    "a100-80gb": GpuSpec("a100-80gb", 312.0, 81_920 * MIB, 2039.0, 300.0, 25.0, 0.70),
    # H100 SXM: 989 TF bf16 dense, 80 GB at 3.35 TB/s, NVLink 4 900 GB/s total; NDR InfiniBand.
    # H100 runs reach a smaller share of their peak than A100 runs (the fits: 0.52 against 0.70).
    "h100-80gb": GpuSpec("h100-80gb", 989.0, 81_559 * MIB, 3350.0, 450.0, 50.0, 0.52),
    # H200 SXM: H100 compute, 141 GB at 4.8 TB/s; no measured H200 run is in the calibration: H100's fit.
    "h200-141gb": GpuSpec("h200-141gb", 989.0, 143_771 * MIB, 4800.0, 450.0, 50.0, 0.52),
}


def get_gpu(name: str) -> GpuSpec:
    """The preset called `name` (case-insensitive)."""
    key = name.lower()
    if key not in GPU_PRESETS:
        raise DsmtError(
            f"unknown GPU preset {name!r}; valid presets: {', '.join(GPU_PRESETS)}. For another accelerator pass "
            "--gpu custom with --gpu-mem-gb, --peak-tflops, --nvlink-gbps and --ib-gbps"
        )
    return GPU_PRESETS[key]


def custom_gpu(
    *, base: GpuSpec | None = None, memory_gb: float | None = None, peak_tflops: float | None = None,
    nvlink_gbps: float | None = None, ib_gbps: float | None = None, hbm_gbps: float | None = None,
) -> GpuSpec:
    """`base` with the given values replaced; with no base every value except hbm_gbps must be given."""
    values = {"memory_gb": memory_gb, "peak_tflops": peak_tflops, "nvlink_gbps": nvlink_gbps, "ib_gbps": ib_gbps}
    if base is None:
        missing = [f"--{k.replace('_', '-')}" for k, v in values.items() if v is None]
        if missing:
            raise DsmtError(f"a custom GPU needs every figure; missing: {', '.join(missing)}")
        # a new accelerator is assumed no better used than H100 (the lower of the fitted efficiencies)
        base = GpuSpec("custom", 0.0, 0, hbm_gbps or 2000.0, 0.0, 0.0, 0.52)
    for key, value in values.items():
        if value is not None and value <= 0:
            raise DsmtError(f"{key} must be positive, got {value}")
    return dataclasses.replace(
        base,
        name=base.name if all(v is None for v in values.values()) else f"{base.name}*",
        memory_bytes=int(memory_gb * 1e9) if memory_gb is not None else base.memory_bytes,
        peak_bf16_tflops=peak_tflops if peak_tflops is not None else base.peak_bf16_tflops,
        nvlink_gbps=nvlink_gbps if nvlink_gbps is not None else base.nvlink_gbps,
        ib_gbps=ib_gbps if ib_gbps is not None else base.ib_gbps,
        hbm_gbps=hbm_gbps if hbm_gbps is not None else base.hbm_gbps,
    )
