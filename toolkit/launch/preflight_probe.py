"""What `dsmt preflight` asks each node: one JSON line of facts; the head node compares them (toolkit/check/preflight.py).

Run on a node as `PYTHON -m toolkit.launch.preflight_probe --run-dir DIR [--device cuda] [--port N]`, with the same
python path as the head. On the CPU it reads only package metadata and answers in well under a second; on cuda
it also imports torch, Transformer Engine and DeepSpeed's fused Adam op (a few seconds). It reports facts, never
verdicts: the head decides what is a problem.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import sys
from pathlib import Path

MARKER = "DSMT_PREFLIGHT"  # the line prefix the head looks for among launcher noise
PACKAGES = ("dsmt", "torch", "deepspeed", "megatron-core")
ENV_FILE = ".deepspeed_env"
IB_SYSFS = Path("/sys/class/infiniband")
NODE_ID_VARS = ("SLURMD_NODENAME", "OMPI_COMM_WORLD_RANK")  # who this is under srun / mpirun


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def read_env_file(path: Path) -> dict[str, str] | None:
    """NAME=value lines of .deepspeed_env (see toolkit/generate/env.py), or None when unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` on all addresses, as the rendezvous store does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def gpu_count() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count()


def import_error(module: str) -> str | None:
    """None when `module` imports here, else the error in one line (Transformer Engine: a CUDA / torch mismatch
    shows here, not at the first layer)."""
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any failure to import is the answer
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def fused_adam_error() -> str | None:
    """None when DeepSpeed's fused Adam (the optimizer of GPU runs without offload) will load: prebuilt and
    loadable, or JIT-buildable (compatible, with nvcc and ninja; the first rank then builds it, ~1 min). Else why."""
    try:
        import deepspeed.git_version_info as installed
        from deepspeed.ops.op_builder import FusedAdamBuilder
    except Exception as err:  # noqa: BLE001
        return f"deepspeed does not import: {type(err).__name__}: {err}".splitlines()[0]
    builder = FusedAdamBuilder()
    if installed.installed_ops.get(builder.NAME):
        try:
            builder.load(verbose=False)
        except Exception as err:  # noqa: BLE001
            return f"the prebuilt fused_adam op does not load: {type(err).__name__}: {err}".splitlines()[0]
        return None
    missing = [tool for tool in ("nvcc", "ninja") if shutil.which(tool) is None and not _in_cuda_home(tool)]
    if not builder.is_compatible(verbose=False) or missing:
        return (f"fused_adam is not prebuilt and cannot be built here (compatible: "
                f"{builder.is_compatible(verbose=False)}, missing: {', '.join(missing) or 'nothing'})")
    return None


def _in_cuda_home(tool: str) -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(home) and (Path(home) / "bin" / tool).is_file()


def kernel_facts() -> dict:
    """What the GPU path loads at start: Transformer Engine (fused attention and layers) and fused Adam."""
    return {"transformer_engine": import_error("transformer_engine.pytorch"), "fused_adam": fused_adam_error()}


def facts(*, run_dir: Path, device: str = "cpu", port: int | None = None) -> dict:
    env_path = run_dir / ENV_FILE
    env_text = env_path.read_bytes() if os.access(env_path, os.R_OK) else None
    return {
        "node": next((os.environ[v] for v in NODE_ID_VARS if v in os.environ), None),
        "hostname": socket.gethostname(),
        "python": sys.executable,
        "versions": package_versions(),
        "run_dir_readable": os.access(run_dir / "job.resolved.yaml", os.R_OK),
        "env_file_sha256": hashlib.sha256(env_text).hexdigest() if env_text is not None else None,
        "env": read_env_file(env_path),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "ib_devices": sorted(p.name for p in IB_SYSFS.iterdir()) if IB_SYSFS.is_dir() else [],
        "gpu_count": gpu_count() if device == "cuda" else None,
        "port_free": port_free(port) if port is not None else None,
        "kernels": kernel_facts() if device == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.launch.preflight_probe")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--port", type=int, default=None, help="report whether this port is free here")
    args = parser.parse_args(argv)
    print(MARKER, json.dumps(facts(run_dir=args.run_dir, device=args.device, port=args.port)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
