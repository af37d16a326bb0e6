"""Every assumption of the planner, named, with its source; the CLI can override each one.

Defaults describe a bf16 megatron-core model trained with DeepSpeed ZeRO data parallelism on NVIDIA GPUs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Assumptions:
    # --- model states (ZeRO paper, Rajbhandari et al. 2020, section 3.1) -----------------------------------
    param_bytes: int = 2            # bf16 working copy
    grad_bytes: int = 2             # bf16 gradients
    # Adam: fp32 master weights + momentum + variance, the paper's K = 12.
    optimizer_bytes_per_param: int = 12
    # DeepSpeed's bf16/ZeRO optimizers also keep an fp32 copy of the (partitioned) gradient; its estimators count
    # it (2_grads_16bit + 4_grads_32bit + ... = 18). Set 0 to get the ZeRO paper's 16 bytes per parameter.
    master_grad_bytes: int = 4
    # --- communication buffers (DeepSpeed defaults, docs "ZeRO optimizations") -----------------------------
    reduce_bucket_elements: int = 500_000_000      # zero_optimization.reduce_bucket_size
    zero3_prefetch_elements: int = 50_000_000      # zero_optimization.stage3_prefetch_bucket_size
    # --- activations (Korthikanti et al. 2022, section 4) --------------------------------------------------
    # Flash / fused attention stores no s x s score matrix (megatron-core default with Transformer Engine);
    # False gives Korthikanti's table, whose 5as/h term is the stored softmax, its dropout mask and output.
    flash_attention: bool = True
    # Llama-family models train without dropout; Korthikanti's 34 counts two 1-byte dropout masks per layer.
    dropout: bool = False
    activation_bytes: int = 2       # bf16 activations
    logits_fp32: bool = True        # vocab-parallel cross entropy upcasts the logits to fp32
    # --- allowance for what no formula covers ---------------------------------------------------------------
    # CUDA context (~0.5 GB), NCCL communicator buffers and workspace (cuBLAS, TE): measured 1.5-3 GB on H100.
    framework_overhead_gb: float = 2.5
    fragmentation_fraction: float = 0.05   # caching allocator slack over states + activations
    # --- time model (Narayanan et al. 2021, section 5) -----------------------------------------------------
    efficiency: float = 0.55        # achieved / peak matmul throughput; Megatron reports 44-52 % MFU at scale
    link_efficiency: float = 0.8    # nccl-tests bus bandwidth / nominal link bandwidth
    dp_overlap: float = 0.5         # share of data-parallel communication hidden behind backward compute
    tp_overlap: float = 0.0         # share of tensor-parallel communication hidden (0: no TP comm overlap)
    collective_latency_s: float = 20e-6   # per collective call, ring startup
    optimizer_passes: int = 3       # Adam reads/writes each state byte ~3 times per step (memory bound)
    # ZeRO-Offload (Ren et al. 2021): DeepSpeed's CPUAdam updates ~1e9 params/s per process; gradients go down
    # and bf16 parameters come back over PCIe Gen4/5 x16 (~25 GB/s achieved).
    cpu_adam_params_per_s: float = 1.0e9
    pcie_gbps: float = 25.0
