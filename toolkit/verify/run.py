"""Launch the verification workers and read their result."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

from toolkit.launch.local import launch_local_workers

DEFAULT_TOLERANCE_FP32 = 1e-4


def run_verify(*, checkpoint: Path, tolerance: float = DEFAULT_TOLERANCE_FP32, **options) -> dict:
    """Run tp*pp ranks; return the result dict (max_abs_diff, kl_divergence, tp, pp, tolerance, passed, ...)."""
    return run_verify_many(checkpoints=[checkpoint], tolerance=tolerance, **options)[0]


def run_verify_many(*, checkpoints: list[Path], tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, batch_size: int = 4,
                    seq_len: int = 32, tolerance: float = DEFAULT_TOLERANCE_FP32, reference: Path | None = None,
                    save_as: Path | None = None, timeout_s: float = 900.0) -> list[dict]:
    """Several checkpoints in one launch (process start-up dominates on small machines)."""
    from toolkit.convert.chunks import check_layout, inspect_checkpoint
    from toolkit.verify.worker import TF32_OFF_ENV, verify_layout

    layout = verify_layout(tp=tp, pp=pp, vpp=vpp, ep=ep)
    for checkpoint in checkpoints:  # bad paths, configs and layouts fail here, before any process starts
        info = inspect_checkpoint(checkpoint)
        check_layout(hf_config=info.hf_config, layout=layout, vocab_pad_multiple=info.vocab_pad_multiple)
    scratch = Path(tempfile.mkdtemp(prefix="dsmt-verify-"))  # kept when a rank fails: its logs are there
    with _removed_on_success(scratch):
        result_file = scratch / "result.json"
        args = [f"--checkpoint={c}" for c in checkpoints]
        args += ["--tp", str(tp), "--pp", str(pp), "--vpp", str(vpp), "--ep", str(ep), "--batch-size", str(batch_size),
                 "--seq-len", str(seq_len), "--result-file", str(result_file)]
        args += ["--reference", str(reference)] if reference is not None else []
        args += ["--save-as", str(save_as)] if save_as is not None else []
        launch_local_workers(module="toolkit.verify.worker", args=args, nprocs=layout.world_size,
                             log_dir=scratch / "logs", timeout_s=timeout_s, env=TF32_OFF_ENV)
        results = json.loads(result_file.read_text())
    for result in results:
        result["tolerance"] = tolerance
        result["passed"] = result["max_abs_diff"] <= tolerance
    return results


@contextlib.contextmanager
def _removed_on_success(directory: Path):
    yield
    shutil.rmtree(directory, ignore_errors=True)
