"""Figures in a unit that shows them. A tiny model's plan (the demo's) has steps of a fraction of a millisecond and
thousands of parameters per GPU, which fixed units print as "0.000 s" and "0.00 B". Each unit is used from a tenth
of itself up, so a real model's figures read as before (0.50 B, 0.120 s, 0.1 GB)."""

from __future__ import annotations

SECONDS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
COUNTS = ((1e9, "B", 2), (1e6, "M", 1), (1e3, "k", 1), (1.0, "", 0))
BYTES = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "bytes"))
FLOPS = ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1.0, "FLOP"))


def _pick(value: float, units):
    """The first unit that `value` reaches a tenth of (the last one otherwise; the first for a true zero)."""
    if value == 0:
        return units[0]
    return next((unit for unit in units if abs(value) >= 0.1 * unit[0]), units[-1])


def time_unit(seconds: float) -> tuple[float, str]:
    """(seconds per unit, name) for `seconds` and the terms that add up to it, which are printed in its unit."""
    return _pick(seconds, SECONDS)


def count_text(count: float) -> str:
    """A parameter count: "8.03 B", "12.3 M", "52.5 k"."""
    scale, name, digits = _pick(count, COUNTS)
    return f"{count / scale:.{digits}f} {name}".rstrip()


def bytes_text(size: float) -> str:
    """A memory size: "16.1 GB", "0.4 MB"."""
    scale, name = _pick(size, BYTES)
    return f"{size / scale:.1f} {name}"


def flops_text(flops: float) -> str:
    """Floating-point operations: "1.2 PFLOP", "3.4 GFLOP"."""
    scale, name = _pick(flops, FLOPS)
    return f"{flops / scale:.1f} {name}"
