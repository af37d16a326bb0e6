"""The planner: memory and step-time models of TP / PP / VPP / DP / ZeRO layouts, and a search over them.

Public API: `memory.estimate_memory`, `layout.PlanLayout` / `TrainingShape` / `Cluster`, `dpo.DpoShape`,
`hardware.GPU_PRESETS` / `get_gpu`, `search.plan`, `timing.estimate_step_time`. No torch / deepspeed / megatron imports here.
"""

from toolkit.plan.dpo import DpoShape
from toolkit.plan.hardware import GPU_PRESETS, GpuSpec, get_gpu
from toolkit.plan.layout import Cluster, PlanLayout, TrainingShape
from toolkit.plan.memory import MemoryBreakdown, estimate_memory

__all__ = ["GPU_PRESETS", "Cluster", "DpoShape", "GpuSpec", "PlanLayout", "MemoryBreakdown", "TrainingShape",
           "estimate_memory", "get_gpu"]
