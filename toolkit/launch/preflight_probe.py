"""What `dsmt preflight` asks each node: one JSON line of facts; the head node compares them (toolkit/check/preflight.py).

Run on a node as `PYTHON -m toolkit.launch.preflight_probe --run-dir DIR [--device cuda] [--port N]`, with the same
python path as the head. On the CPU it reads only package metadata and answers in well under a second; on cuda
it also imports torch, Transformer Engine and DeepSpeed's fused Adam op, and compiles one small fused kernel with
torch.compile as megatron's fusions do at the first step (seconds; 10-30 s with a cold compile cache). It reports
facts, never verdicts: the head decides what is a problem.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from toolkit.launch.env_report import distribution_version

MARKER = "DSMT_PREFLIGHT"  # the line prefix the head looks for among launcher noise
PACKAGES = ("dsmt", "torch", "deepspeed", "megatron-core")
ENV_FILE = ".deepspeed_env"
IB_SYSFS = Path("/sys/class/infiniband")
NODE_ID_VARS = ("SLURMD_NODENAME", "OMPI_COMM_WORLD_RANK")  # who this is under srun / mpirun


def package_versions() -> dict[str, str | None]:
    return {name: distribution_version(names=(name,)) for name in PACKAGES}


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
    """What the GPU path loads at start: Transformer Engine (fused attention and layers) and fused Adam; and what
    megatron's fused kernels compile at the first step (`fused_compile_facts`)."""
    return {"transformer_engine": import_error("transformer_engine.pytorch"), "fused_adam": fused_adam_error(),
            "fused_compile": fused_compile_facts()}


def bias_swiglu(y, bias):
    """megatron-core 0.16.1's `fusions/fused_bias_swiglu.bias_swiglu`: bias add, split, silu(y1) * y2."""
    import torch

    y_1, y_2 = torch.chunk(y + bias, 2, -1)
    return torch.nn.functional.silu(y_1) * y_2


def fused_compile_facts(*, device: str = "cuda") -> dict:
    """megatron-core wraps its fused kernels (bias + SwiGLU / GeLU, bias + dropout + add) in
    `megatron.core.jit.jit_fuser`, which is torch.compile on torch >= 2.2: at the first forward Inductor writes
    Triton kernels and Triton builds their launcher with the host C compiler against libcuda. This compiles the
    same kind of function (forward and backward) once on `device` and times it: `error` None means it ran. The
    other facts say which piece is there when it did not."""
    found = {"c_compiler": c_compiler(), "libcuda": libcuda_dirs(),
             "triton": distribution_version(names=("triton", "pytorch-triton")),  # PyPI's, PyTorch nightlies' name
             "python_headers": python_headers(), "error": None, "seconds": None, "skipped": None}
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - the answer is that it does not import
        return found | {"error": error_line(err)}
    if device == "cuda" and not torch.cuda.is_available():
        return found | {"skipped": "no CUDA device is visible (the GPU count says so)"}
    start = time.perf_counter()
    # Fresh caches: a warm Inductor / Triton cache would let the compile pass without calling the C compiler.
    with tempfile.TemporaryDirectory(prefix="dsmt-preflight-compile-") as cache, environment(
            {"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}):
        return found | compile_once(torch, device=device, start=start)


def compile_once(torch, *, device: str, start: float) -> dict:
    """{"error", "seconds"} of one compiled bias + SwiGLU, forward and backward, on `device`."""
    try:
        fused = torch.compile(bias_swiglu)  # lazy: the compile happens at the first call
        y = torch.randn(4, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(256, device=device, dtype=torch.bfloat16, requires_grad=True)
        fused(y, bias).float().sum().backward()  # the backward is compiled too, as megatron's training needs
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - any failure is the answer
        return {"error": error_line(err), "seconds": round(time.perf_counter() - start, 1)}
    return {"error": None, "seconds": round(time.perf_counter() - start, 1)}


def error_line(err: BaseException, limit: int = 300) -> str:
    """One line for a failure: the root of its chain, which names the missing piece (dynamo wraps Inductor's
    error as "BackendCompilerFailed: backend='inductor' raised:" with the cause on the next line)."""
    root, seen = err, {id(err)}
    while True:
        inner = (getattr(root, "inner_exception", None) or root.__cause__
                 or (None if root.__suppress_context__ else root.__context__))
        if not isinstance(inner, BaseException) or id(inner) in seen:
            break
        root = inner
        seen.add(id(root))
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    text = f"{type(root).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if root is not err:
        text = f"{type(err).__name__} <- {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def c_compiler() -> str | None:
    """The C compiler Triton builds its launcher with, in its order (triton/runtime/build.py): $CC, else gcc, else
    clang (a plain `cc` is not looked for)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def libcuda_dirs() -> str | None:
    """The folder(s) of libcuda.so.1 as Triton finds them (it links its launcher against libcuda): Triton's own
    `libcuda_dirs()` where Triton imports, else its lookup done here: TRITON_LIBCUDA_PATH, else `ldconfig -p`, else
    LD_LIBRARY_PATH. None when none is found."""
    try:
        driver = importlib.import_module("triton.backends.nvidia.driver")
        lookup = driver.libcuda_dirs
    except Exception:  # noqa: BLE001 - no Triton here (or another layout of it): look as it does
        lookup = None
    if lookup is not None:
        try:
            return ":".join(lookup()) or None
        except Exception:  # noqa: BLE001 - Triton asserts when it finds none
            return None
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return os.environ["TRITON_LIBCUDA_PATH"]
    try:
        listing = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    dirs = sorted({os.path.dirname(line.split()[-1]) for line in listing.splitlines() if "libcuda.so.1" in line})
    if not dirs:
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                if d and os.path.exists(os.path.join(d, "libcuda.so.1"))]
    return ":".join(dirs) or None


def python_headers() -> bool:
    """Whether Python.h is where Triton's launcher build looks for it (Debian's posix_local scheme read as
    posix_prefix, as Triton does): a system python without python3-dev fails there."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    return (Path(sysconfig.get_paths(scheme=scheme)["include"]) / "Python.h").is_file()


def facts(*, run_dir: Path, device: str = "cpu", port: int | None = None) -> dict:
    env_path = run_dir / ENV_FILE
    env_text = env_path.read_bytes() if os.access(env_path, os.R_OK) else None
    env = read_env_file(env_path)
    return {
        "node": next((os.environ[v] for v in NODE_ID_VARS if v in os.environ), None),
        "hostname": socket.gethostname(),
        "python": sys.executable,
        "versions": package_versions(),
        "run_dir_readable": os.access(run_dir / "job.resolved.yaml", os.R_OK),
        "env_file_sha256": hashlib.sha256(env_text).hexdigest() if env_text is not None else None,
        "env": env,
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "ib_devices": sorted(p.name for p in IB_SYSFS.iterdir()) if IB_SYSFS.is_dir() else [],
        "gpu_count": gpu_count() if device == "cuda" else None,
        "port_free": port_free(port) if port is not None else None,
        "kernels": ranks_kernel_facts(env=env) if device == "cuda" else None,
    }


def ranks_kernel_facts(*, env: dict[str, str] | None) -> dict:
    """`kernel_facts` in the environment the ranks get: .deepspeed_env's variables (communication.extra_env: a CC,
    TRITON_LIBCUDA_PATH, PATH or LD_LIBRARY_PATH set for the ranks) over this process's; restored after."""
    with environment(env or {}):
        return kernel_facts()


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """os.environ with `values` set inside, as it was after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
