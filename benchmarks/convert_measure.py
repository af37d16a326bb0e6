"""Measuring a conversion: a large generated checkpoint, and a child process run under a resident-memory cap.

Shared by `benchmarks/convert_speed.py` and the capped-memory test (tests/convert/test_convert_memory.py). The cap
is watched from outside: the child's VmRSS is polled every 20 ms and the child is killed the moment it passes the
cap; its peak is the kernel's own high-water mark (VmHWM, reported by the child at exit), not a sample.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from toolkit.convert.progress import proc_status_bytes

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=32000, max_position_embeddings=4096)


def write_random_checkpoint(path: Path, *, num_layers: int, shard_bytes: int = 2**30, **config) -> tuple[int, int]:
    """A Llama-shaped bf16 HF checkpoint of random tensors (config.json + safetensors shards + index), written one
    tensor at a time. Returns (total bytes, largest tensor bytes)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_config = LlamaConfig(num_hidden_layers=num_layers, dtype="bfloat16", **{**LLAMA_1B, **config})
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    path.mkdir(parents=True)
    hf_config.save_pretrained(path)
    shard, shard_size, weight_map, total, largest = {}, 0, {}, 0, 0
    generator = torch.Generator().manual_seed(0)

    def flush():
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})

    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
        nbytes = tensor.numel() * 2
        total, largest = total + nbytes, max(largest, nbytes)
        if shard and shard_size + nbytes > shard_bytes:
            flush()
            shard, shard_size = {}, 0
        shard[name], shard_size = tensor, shard_size + nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, largest


@dataclasses.dataclass(frozen=True)
class Measured:
    seconds: float
    peak_rss_bytes: int  # the child's VmHWM at exit
    returncode: int
    killed_at_bytes: int | None  # VmRSS when the watchdog killed it, None when it finished under the cap
    output: str


_CHILD = ("import sys; from toolkit.cli import main; from toolkit.convert.progress import peak_rss_bytes; "
          "code = main(sys.argv[1:]); print('peak_rss_bytes', peak_rss_bytes(), flush=True); sys.exit(code)")


def run_dsmt(argv: list[str], *, rss_cap_bytes: int | None = None) -> Measured:
    """Run `dsmt argv` in a fresh Python process; kill it if its resident memory passes `rss_cap_bytes`."""
    return run_python(_CHILD, argv, rss_cap_bytes=rss_cap_bytes)


def run_python(code: str, argv: list[str], *, rss_cap_bytes: int | None = None, poll_s: float = 0.02) -> Measured:
    """Run `python -c code argv` under the watchdog."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    killed_at = None
    while child.poll() is None:
        rss = proc_status_bytes("VmRSS", pid=child.pid) or 0  # 0 once the child has exited
        if rss_cap_bytes is not None and rss > rss_cap_bytes:
            child.kill()
            killed_at = rss
            break
        time.sleep(poll_s)
    output = child.communicate()[0]
    seconds = time.perf_counter() - started
    peak = [int(line.split()[1]) for line in output.splitlines() if line.startswith("peak_rss_bytes ")]
    return Measured(seconds, peak[-1] if peak else 0, child.returncode, killed_at, output)


def import_baseline_rss() -> int:
    """Peak RSS of a process that only imports what a conversion imports."""
    code = ("import torch, megatron.core, transformers, safetensors, toolkit.cli; "
            "from toolkit.convert.progress import peak_rss_bytes; print(peak_rss_bytes())")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(done.stdout.strip().splitlines()[-1])
