"""`dsmt env`: what this machine has and which backend dsmt would use (what `ds_report` is for DeepSpeed).

Versions come from package metadata, so deepspeed, megatron and transformers are never imported (no import-time
warnings, a quick answer); torch is imported for the CUDA facts. The backend decision mirrors
`toolkit.backend.current()` without calling it: on a CPU machine that installs process-wide patches.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import sys

# Report key -> distribution names to try, first found wins. Transformer Engine ships as `transformer_engine`
# (NGC containers, source builds, the PyPI meta package) or only as its parts (`transformer_engine_cu12`, the
# core library, and `transformer_engine_torch`, the PyTorch extension). Metadata lookup treats - and _ alike.
PACKAGE_DISTRIBUTIONS = {
    "torch": ("torch",),
    "deepspeed": ("deepspeed",),
    "megatron-core": ("megatron-core",),
    "transformers": ("transformers",),
    "datasets": ("datasets",),
    "safetensors": ("safetensors",),
    "transformer_engine": ("transformer_engine", "transformer_engine_cu12", "transformer_engine_torch"),
}
LAUNCH_VARIABLES = (
    "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE",
    "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "DSMT_SHOW_WARNINGS", "DSMT_VERBOSE",
)


@dataclasses.dataclass(frozen=True)
class CudaFacts:
    build: str | None  # torch.version.cuda; None for a CPU build of torch
    available: bool
    device_count: int
    devices: list[str]  # device names, index order
    nccl: str | None
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES, None when unset


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    name: str  # "cuda" or "cpu", as toolkit.backend.Backend.name
    dist_backend: str  # "nccl" or "gloo"
    layers: str  # "transformer_engine" or "local" (megatron's own layer spec)
    reason: str


@dataclasses.dataclass(frozen=True)
class EnvironmentReport:
    dsmt: str | None
    python: str
    python_executable: str
    packages: dict[str, str | None]
    cuda: CudaFacts
    backend: BackendChoice
    environment: dict[str, str]  # the launch variables that are set

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def register(subparsers) -> None:
    parser = subparsers.add_parser("env", help="versions, GPUs and the backend dsmt would use on this machine")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.set_defaults(func=run_env_command)


def run_env_command(args: argparse.Namespace) -> int:
    report = collect_environment(environ=os.environ)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_text(report=report))
    return 0


def distribution_version(*, names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def transformer_engine_importable() -> bool:
    """The test `toolkit.backend.current()` uses: finds the package without importing it."""
    return importlib.util.find_spec("transformer_engine") is not None


def collect_environment(*, environ) -> EnvironmentReport:
    import torch

    cuda = collect_cuda(environ=environ)
    backend = choose_backend(
        cuda_available=cuda.available, has_transformer_engine=transformer_engine_importable(),
        cuda_build=cuda.build, device_count=cuda.device_count, nccl_version=cuda.nccl,
        visible_devices=cuda.visible_devices, torch_version=torch.__version__,
    )
    return EnvironmentReport(
        dsmt=distribution_version(names=("dsmt",)),
        python=sys.version.split()[0],
        python_executable=sys.executable,
        packages={key: distribution_version(names=names) for key, names in PACKAGE_DISTRIBUTIONS.items()},
        cuda=cuda,
        backend=backend,
        environment={name: environ[name] for name in LAUNCH_VARIABLES if name in environ},
    )


def collect_cuda(*, environ) -> CudaFacts:
    import torch

    build = torch.version.cuda
    available = torch.cuda.is_available()
    device_count = torch.cuda.device_count() if available else 0
    return CudaFacts(
        build=build,
        available=available,
        device_count=device_count,
        devices=[torch.cuda.get_device_name(index) for index in range(device_count)],
        nccl=read_nccl_version() if build is not None else None,
        visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
    )


def read_nccl_version() -> str | None:
    try:
        import torch.cuda.nccl

        version = torch.cuda.nccl.version()
    except Exception:  # a CUDA build without NCCL, or a broken driver: report, don't fail
        return None
    if isinstance(version, tuple):  # (2, 21, 5), or (2, 21, 5, "suffix")
        return ".".join(str(part) for part in version)
    return str(version)  # older torch: one integer, e.g. 2708


def choose_backend(*, cuda_available: bool, has_transformer_engine: bool, cuda_build: str | None = None,
                   device_count: int = 0, nccl_version: str | None = None, visible_devices: str | None = None,
                   torch_version: str = "?") -> BackendChoice:
    """The decision of `toolkit.backend.current()`, with a one-sentence reason built from the facts behind it."""
    if not cuda_available:
        return BackendChoice(name="cpu", dist_backend="gloo", layers="local",
                             reason=_cpu_reason(cuda_build=cuda_build, visible_devices=visible_devices,
                                                torch_version=torch_version))
    devices = f"{device_count} CUDA device{'s' if device_count != 1 else ''}"
    if visible_devices is not None:
        devices += f" (CUDA_VISIBLE_DEVICES={visible_devices!r})"
    layers_reason = ("Transformer Engine layers" if has_transformer_engine
                     else "Transformer Engine is not installed, so megatron's local layers")
    return BackendChoice(name="cuda", dist_backend="nccl",
                         layers="transformer_engine" if has_transformer_engine else "local",
                         reason=f"{devices}, NCCL {nccl_version or 'unknown'}; {layers_reason}")


def _cpu_reason(*, cuda_build: str | None, visible_devices: str | None, torch_version: str) -> str:
    if cuda_build is None:
        return f"torch.cuda.is_available() is False (torch {torch_version} is a CPU build)"
    if visible_devices is not None and visible_devices.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible_devices!r} hides the GPUs"
    visible = f", CUDA_VISIBLE_DEVICES={visible_devices!r}" if visible_devices is not None else ""
    return (f"torch.cuda.is_available() is False although torch {torch_version} is built for CUDA {cuda_build}"
            f"{visible}: no GPU visible or no working driver (check nvidia-smi)")


def format_text(*, report: EnvironmentReport) -> str:
    sections = {
        "versions": _version_rows(report=report),
        "devices": _device_rows(cuda=report.cuda),
        "backend": [("name", report.backend.name), ("dist backend", report.backend.dist_backend),
                    ("layers", report.backend.layers), ("reason", report.backend.reason)],
        "environment": [(name, value or "''") for name, value in report.environment.items()] or [("(none set)", "")],
    }
    width = max(len(label) for rows in sections.values() for label, _ in rows)
    blocks = [title + "\n" + "\n".join(f"  {label:<{width}}  {value}".rstrip() for label, value in rows)
              for title, rows in sections.items()]
    return "\n\n".join(blocks)


def _version_rows(*, report: EnvironmentReport) -> list[tuple[str, str]]:
    rows = [("dsmt", report.dsmt or "not installed"),
            ("python", f"{report.python}  {report.python_executable}")]
    rows += [(name, version or "not installed") for name, version in report.packages.items()]
    return rows


def _device_rows(*, cuda: CudaFacts) -> list[tuple[str, str]]:
    names = collections.Counter(cuda.devices)  # 8 identical GPUs read as one line
    rows = [
        ("CUDA build", cuda.build or "none (CPU build of torch)"),
        ("CUDA available", "yes" if cuda.available else "no"),
        ("GPUs", ", ".join(f"{count} x {name}" for name, count in names.items()) or "0"),
        ("NCCL", cuda.nccl or "-"),
    ]
    if cuda.visible_devices is not None:
        rows.append(("CUDA_VISIBLE_DEVICES", repr(cuda.visible_devices)))
    return rows
