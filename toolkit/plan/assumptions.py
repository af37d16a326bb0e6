"""Every assumption of the planner, named, with its source; `dsmt plan` overrides the main ones (its --help lists
them), a job spec sets the communication ones (buckets, communication_data_type, overlap_comm).

Defaults describe a bf16 megatron-core model trained with DeepSpeed ZeRO data parallelism on NVIDIA GPUs with
Transformer Engine layers. `Assumptions.for_precision("fp32")` gives the byte widths of an fp32 run; `dsmt check`
builds its assumptions the same way from the job spec (`toolkit/check/checks.py: planner_inputs`), so check and
plan agree.
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError

# Bytes of one element of the working weights, 16-bit gradients and activations, per training precision.
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ATTENTION_KINDS = ("fused", "local")
DP_ENGINES = ("deepspeed", "megatron", "fsdp")
LAYER_SPECS = ("te", "local")


@dataclasses.dataclass(frozen=True)
class Assumptions:
    # --- model states: which DeepSpeed 0.19 buffers exist (toolkit/plan/model_states.py) -------------------
    # The training precision decides the optimizer DeepSpeed builds around dsmt's config: fp32 runs keep no
    # 16-bit copies; bf16/fp16 runs keep fp32 master weights and accumulate gradients in fp32 at ZeRO >= 1.
    precision: str = "bf16"
    param_bytes: int = 2            # working weights (the model's parameters)
    grad_bytes: int = 2             # gradients in the working precision (param.grad)
    # fp32 master weights + Adam's two moments: the ZeRO paper's K = 12 (Rajbhandari et al. 2020, section 3.1).
    optimizer_bytes_per_param: int = 12
    master_weight_bytes: int = 4    # the part of K that is the fp32 master copy (an fp32 run at ZeRO-0 has none)
    # fp32 gradients: DeepSpeed's bf16 optimizers accumulate into fp32 buffers (data_types.grad_accum_dtype fp32)
    # and hand the optimizer an fp32 gradient partition (its estimators count it: 2 + 4 + 12 = 18 per param).
    master_grad_bytes: int = 4
    # --- communication buffers (DeepSpeed defaults, docs "ZeRO optimizations"; the spec's communication) ------
    reduce_bucket_elements: int = 500_000_000      # zero_optimization.reduce_bucket_size
    overlap_comm: bool = True                      # zero_optimization.overlap_comm: two reduce buckets, not one
    zero3_prefetch_elements: int = 50_000_000      # zero_optimization.stage3_prefetch_bucket_size
    # zero_optimization.stage3_param_persistence_threshold: smaller parameters stay whole on every rank
    zero3_persistence_threshold: int = 100_000
    # zero_optimization.stage3_max_reuse_distance: parameters reused within it stay gathered (DeepSpeed's default)
    zero3_max_reuse_distance: int = 1_000_000_000
    # --- activations (Korthikanti et al. 2022, section 4; megatron-core's local layers as measured) ---------
    # Core attention: "fused" (Transformer Engine / flash: no s x s scores stored) or "local" (megatron-core's
    # DotProductAttention: keeps the softmax output and the probabilities, s x s per head; toolkit/plan/activations.py).
    attention: str = "fused"
    # The layers around it: "te" (Transformer Engine: norms fused into the next linear, fused SwiGLU; Korthikanti's
    # counting) or "local" (megatron-core's local spec as dsmt builds it without TE: torch RMSNorm keeping fp32
    # copies, megatron's unfused SwiGLU).
    layer_spec: str = "te"
    # megatron's masked_softmax_fusion: its CUDA kernel stores only the 16-bit softmax output (Korthikanti's 2as);
    # dsmt sets it off (toolkit/adapters/hf_config.py), so the unfused softmax keeps an fp32 output too.
    softmax_fusion: bool = False
    # Llama-family models train without dropout; Korthikanti's 34 counts two 1-byte dropout masks per layer.
    dropout: bool = False
    activation_bytes: int = 2       # bf16 activations

    def __post_init__(self):
        checks = (("precision", self.precision, tuple(PRECISION_BYTES)), ("attention", self.attention, ATTENTION_KINDS),
                  ("layer_spec", self.layer_spec, LAYER_SPECS), ("dp_engine", self.dp_engine, DP_ENGINES))
        for name, value, valid in checks:
            if value not in valid:
                raise DsmtError(f"assumption {name}={value!r} is not one of {', '.join(valid)}")
        if self.checkpoint_write_gbps <= 0:
            raise DsmtError(f"assumption checkpoint_write_gbps={self.checkpoint_write_gbps} must be positive: the "
                            "GB/s one node writes to the checkpoint filesystem (e.g. 2)")
        if self.router_imbalance < 1.0:
            raise DsmtError(f"assumption router_imbalance={self.router_imbalance} is below 1; it is the busiest "
                            "expert-parallel rank's routed tokens over the mean (1.0: perfectly balanced)")

    @classmethod
    def for_precision(cls, precision: str, **changes) -> "Assumptions":
        """The assumptions of a `precision` run: its weight, gradient and activation widths, plus `changes`."""
        if precision not in PRECISION_BYTES:
            raise DsmtError(f"precision={precision!r} is not one of {', '.join(PRECISION_BYTES)}")
        width = PRECISION_BYTES[precision]
        return cls(**{"precision": precision, "param_bytes": width, "grad_bytes": width, "activation_bytes": width,
                      **changes})

    @property
    def adam_moment_bytes(self) -> int:
        """Adam's exp_avg + exp_avg_sq per parameter: K without the master copy."""
        return self.optimizer_bytes_per_param - self.master_weight_bytes

    # --- allowance for what no formula covers ---------------------------------------------------------------
    # CUDA context (~0.5 GB), NCCL communicator buffers and workspace (cuBLAS, TE): measured 1.5-3 GB on H100.
    framework_overhead_gb: float = 2.5
    fragmentation_fraction: float = 0.05   # caching allocator slack over states + activations
    # --- time model (toolkit/plan/timing.py; calibrated on the measured runs of toolkit/plan/published.py and
    # published_sharded.py, tests/plan/test_calibration.py; `dsmt plan --calibration` prints the table) ---------
    # Achieved / peak throughput of the layers' matmuls. None: the GPU preset's fitted value (hardware.py:
    # GpuSpec.matmul_efficiency, A100 0.70, H100 0.52), the least-squares fit in log space to the runs on it.
    efficiency: float | None = None
    link_efficiency: float = 0.8    # nccl-tests bus bandwidth / nominal link bandwidth (PERFORMANCE.md)
    # Memory-bound kernels between the matmuls (norms, residual adds, activation function, dropout, softmax) run
    # at HBM bandwidth. timing.py counts the bf16 tensors each reads and writes in the forward (Korthikanti et al.
    # 2022 list the same tensors); backward kernels read input and gradient and write a gradient: ~2x forward.
    elementwise_backward_factor: float = 2.0
    # Share of the hookable data-parallel traffic (ZeRO-2/3 with overlap_comm at pp = 1; zero_traffic.py) hidden
    # behind compute, and DeepSpeed's data-parallel collective latency as a multiple of NCCL's model. Both are
    # fitted jointly to DeepSpeed's measured ZeRO-3 runs (GPT 175B / 530B on 128-1,024 A100s,
    # published_sharded.py DS_AZURE): they fall with GPU count at micro-batch 1 as ring latency grows, and hide
    # almost nothing. PyTorch FSDP (the MPT and IBM rows) overlaps far more (`fsdp_overlap`, fitted on them) and
    # shows no extra latency; dsmt's engine is DeepSpeed, so plans use the DeepSpeed figures.
    dp_overlap: float = 0.1
    deepspeed_latency_scale: float = 3.5
    fsdp_overlap: float = 0.7
    dp_grad_comm_bytes: int = 4     # dsmt's ds_config communication_data_type "fp32" (megatron's default)
    # What sends the data-parallel traffic (toolkit/plan/zero_traffic.py): "deepspeed" (dsmt's engine); the
    # published runs the model is calibrated on also ran "megatron" (DDP / distributed optimizer) and "fsdp".
    dp_engine: str = "deepspeed"
    tp_overlap: float = 0.0         # dsmt runs megatron-core's TP collectives without userbuffer overlap
    # Share of context parallelism's ring K/V exchange hidden behind the attention it feeds: Transformer Engine
    # posts step i+1's send/recv before step i's attention kernel (megatron-core CP, TE AttnFuncWithCPAndKVP2P);
    # the first step's exchange and the load imbalance of the causal chunks stay exposed.
    cp_overlap: float = 0.9
    # NCCL's cost model (src/graph/tuning.cc, ring / Simple protocol; toolkit/plan/collectives.py): a base latency
    # per call (also taken for a point-to-point send) plus one hop latency per ring step, NVLink or network.
    collective_latency_s: float = 8.4e-6
    nvlink_hop_latency_s: float = 3.4e-6
    net_hop_latency_s: float = 9.6e-6
    optimizer_passes: int = 3       # Adam reads/writes each state byte ~3 times per step (memory bound)
    # ZeRO-Offload (Ren et al. 2021): DeepSpeed's CPUAdam updates ~1e9 params/s per process; gradients go down
    # and bf16 parameters come back over PCIe Gen4/5 x16 (~25 GB/s achieved).
    cpu_adam_params_per_s: float = 1.0e9
    pcie_gbps: float = 25.0
    # Relative uncertainty of a predicted step time: layouts predicted within it of the fastest count as ties and
    # the simplest of them is chosen (search.py: SIMPLICITY_ORDER). 6 %: about the RMS of log(predicted /
    # measured) over the tensor / pipeline runs (calibration.py prints each kind's band with every plan).
    time_uncertainty: float = 0.06
    # --- mixture of experts (toolkit/plan/experts.py) -------------------------------------------------------
    # Routed tokens the busiest expert-parallel rank receives over the mean: 1.0 is perfectly balanced routing
    # (what megatron-core's auxiliary load-balancing loss aims at); real routers run a few tens of percent above
    # it, more early in training. The step waits on that rank, so its expert compute and activations scale by it.
    router_imbalance: float = 1.0
    # --- checkpoints (toolkit/plan/checkpoint_cost.py) -----------------------------------------------------------
    # Sustained write bandwidth of one node to the checkpoint filesystem, GB/s. Conservative for a parallel
    # filesystem client: Lustre / GPFS clients behind one 100-200 Gb/s link sustain ~2-10 GB/s of large
    # sequential writes; NFS and object-store mounts give less. `dsmt plan --checkpoint-write-gbps` sets a cluster's.
    checkpoint_write_gbps: float = 2.0
