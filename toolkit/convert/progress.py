"""What a conversion shows: a progress bar in bytes (tqdm prints the rate as MB/s or GB/s) and one summary line."""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import sys
import threading
from pathlib import Path


@contextlib.contextmanager
def byte_progress(*, total_bytes: int, description: str, enabled: bool):
    """Yield `advance(nbytes)`, safe to call from several writer threads."""
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc=description,
              disable=not enabled, file=sys.stderr, dynamic_ncols=True) as bar:
        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        yield advance


def proc_status_bytes(field: str, *, pid: int | str = "self") -> int | None:
    """A memory field of /proc/PID/status (`VmRSS`, `VmHWM`: reported in kB) in bytes; None where it is not there."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: the kernel's high-water mark VmHWM. Not ru_maxrss, which Linux
    carries over from the parent through fork and exec (a child of a 10 GB process reports at least 10 GB)."""
    peak = proc_status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    direction: str  # "hf-to-mcore" or "mcore-to-hf"
    out_dir: Path
    tensors: int  # HF tensors read or written
    nbytes: int  # bytes of tensor data written
    files: int  # tensor files written
    seconds: float
    peak_rss_bytes: int
    dtype: str
    # HF tensors (name patterns, `*` = a number) stored in a wider dtype than `dtype` and rounded to it, e.g. the
    # float32 router weights transformers keeps in a bf16 DeepSeek checkpoint: megatron's parameters share one dtype.
    rounded: tuple[str, ...] = ()

    def line(self) -> str:
        rate = self.nbytes / 1e9 / max(self.seconds, 1e-9)
        line = (f"dsmt convert {self.direction}: {self.tensors} tensors, {self.nbytes / 1e9:.2f} GB ({self.dtype}) "
                f"in {self.files} file(s), {self.seconds:.1f} s ({rate:.2f} GB/s), peak memory "
                f"{self.peak_rss_bytes / 2**30:.2f} GiB -> {self.out_dir}")
        if self.rounded:
            line += (f"\nnote: {', '.join(self.rounded)} stored in a wider dtype than {self.dtype} are rounded to "
                     f"{self.dtype} (megatron's parameters share one dtype); an export writes them back in their "
                     "own dtype, with the rounded values")
        return line
