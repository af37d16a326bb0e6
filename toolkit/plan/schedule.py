"""Event simulation of megatron-core's 1F1B pipeline schedule (plain and interleaved), for the timeline chart.

The op order per stage is megatron-core's (schedules.py): warm-up forwards, then one-forward-one-backward, then
cool-down backwards; interleaving maps virtual micro-batch k to model chunk (k // p) % v. Each op starts when
its stage is free and its producer on the neighbouring stage has finished. The makespan reproduces the
bubble formula: (m + (p-1)/v) · (t_forward + t_backward).
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError


@dataclasses.dataclass(frozen=True)
class Op:
    stage: int
    kind: str          # "F" or "B"
    micro_batch: int
    chunk: int
    start: float
    end: float


def _stage_order(*, stage: int, pp: int, vpp: int, num_micro: int) -> list[tuple[str, int, int]]:
    total = num_micro * vpp
    if vpp == 1:
        warmup = min(pp - stage - 1, num_micro)
    else:
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % vpp
        micro = (k // (pp * vpp)) * pp + k % pp
        return micro, (chunk if forward else vpp - 1 - chunk)

    order = [("F", *unit(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        order.append(("F", *unit(warmup + i, True)))
        order.append(("B", *unit(i, False)))
    order += [("B", *unit(k, False)) for k in range(total - warmup, total)]
    return order


def _dependency(kind, micro, chunk, stage, pp, vpp):
    if kind == "F":
        if stage > 0:
            return ("F", micro, chunk, stage - 1)
        return ("F", micro, chunk - 1, pp - 1) if chunk > 0 else None
    if stage < pp - 1:
        return ("B", micro, chunk, stage + 1)
    return ("B", micro, chunk + 1, 0) if chunk < vpp - 1 else ("F", micro, chunk, stage)


def simulate_pipeline(*, pp: int, vpp: int, num_micro: int, forward_s: float = 1.0,
                      backward_s: float = 2.0) -> list[Op]:
    """Ops of one step; forward_s / backward_s are one micro-batch's times through a whole stage."""
    if vpp > 1 and num_micro % pp:
        raise DsmtError(f"the interleaved schedule needs num_micro ({num_micro}) divisible by pp ({pp})")
    orders = [_stage_order(stage=s, pp=pp, vpp=vpp, num_micro=num_micro) for s in range(pp)]
    done: dict[tuple, float] = {}
    cursor, free_at, ops = [0] * pp, [0.0] * pp, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for stage in range(pp):
            while cursor[stage] < len(orders[stage]):
                kind, micro, chunk = orders[stage][cursor[stage]]
                dep = _dependency(kind, micro, chunk, stage, pp, vpp)
                if dep is not None and dep not in done:
                    break
                start = max(free_at[stage], done[dep] if dep is not None else 0.0)
                end = start + (forward_s if kind == "F" else backward_s) / vpp
                done[(kind, micro, chunk, stage)] = end
                ops.append(Op(stage, kind, micro, chunk, start, end))
                free_at[stage], cursor[stage] = end, cursor[stage] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise DsmtError(f"pipeline schedule deadlocked (pp={pp}, vpp={vpp}, m={num_micro}); please report")
    return ops
