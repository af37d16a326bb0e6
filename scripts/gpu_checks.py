"""The GPU check's in-process programs: each is one case's process (scripts/gpu_cases.py starts it in its own
process group) and writes what it measured to --out as JSON; gpu_cases.py compares the figures
(scripts/gpu_numerics.py holds the bounds).

    python scripts/gpu_checks.py toolchain --out F          # Transformer Engine, DeepSpeed's fused Adam, torch.compile
    python scripts/gpu_checks.py verify --out F --tp 1 --pp 1 CKPT...     # run_verify_many: every family in ONE launch
    python scripts/gpu_checks.py packing --out F --model DIR --data FILE  # per-record losses, packed and unpacked
    torchrun --nproc_per_node 1 scripts/gpu_checks.py api --out F --spec S --data FILE   # toolkit.api, CUDA batches
    python scripts/gpu_checks.py lora-peft --out F --spec S       # `dsmt train` with LoRA, then HF + PEFT on the CPU
    python scripts/gpu_checks.py resume --out F --spec S --source RUN --step 2   # cut a run back, `dsmt train` on
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def toolchain(args) -> dict:
    """What the first step of a run compiles or builds, timed here once, before the training cases (which then
    find the caches warm): TE's import, DeepSpeed's FusedAdam (prebuilt, or built now by its JIT), and megatron's
    jit-fused bias-SwiGLU (torch.compile: Inductor writes Triton kernels, built with the host C compiler). Each
    is tried whatever the others did; `errors` names what failed."""
    import importlib.metadata as md

    import torch

    facts, errors = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}, {}
    for name, step in (("transformer_engine", _import_te), ("fused_adam", _load_fused_adam),
                       ("compile", _compile_fused)):
        started = time.perf_counter()
        try:
            facts[name] = step()
        except Exception as err:  # reported by name; the next step is still tried
            errors[name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        facts[f"{name}_s"] = round(time.perf_counter() - started, 2)
    facts["errors"] = errors
    if facts.get("transformer_engine") == "imported":
        facts["transformer_engine"] = next((md.version(d) for d in ("transformer-engine", "transformer_engine")
                                            if _installed(md, d)), "imported")
    return facts


def _installed(md, dist: str) -> bool:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        return False
    return True


def _import_te() -> str:
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:  # not installed: its cases say SKIP themselves
        return "not installed"
    import transformer_engine  # noqa: F401  (installed but broken: an error)

    return "imported"


def _load_fused_adam() -> str:
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import FusedAdamBuilder

    FusedAdamBuilder().load(verbose=False)
    return "prebuilt" if installed_ops.get("fused_adam") else "JIT-built (cached for the runs)"


def _compile_fused() -> str:
    """megatron's bias-SwiGLU as the training calls it: the first call compiles forward and backward."""
    import torch
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    timings = []
    for _ in range(2):
        y = torch.randn(512, 2 * 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(2 * 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        bias_swiglu_impl(y, bias).float().sum().backward()
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    return f"first call {timings[0]:.1f} s, then {timings[1] * 1e3:.1f} ms"


def verify(args) -> dict:
    from toolkit.verify.run import run_verify_many

    results = run_verify_many(checkpoints=args.checkpoints, tp=args.tp, pp=args.pp, seq_len=args.seq_len,
                              timeout_s=args.timeout_s)
    return {"results": results}


def packing(args) -> dict:
    """Per-record (counted tokens, loss sum) of every record of `args.data`, packed (several records a row: THD on
    Transformer Engine's attention, a block-diagonal mask on the local one) and unpacked (one record a row), the
    same weights in one process, forward only; and a control: the packed rows with their boundaries hidden
    (positions 0 .. s-1, so records attend to their predecessors), which should NOT match."""
    import torch
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.data import build_examples
    from toolkit.launch.local import single_process_group
    from toolkit.parallel.layout import Layout
    from toolkit.spec.schema import DataSpec

    backend = backends.current()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    backends.use_rank_device(environ={})
    with single_process_group(dist_backend=backend.dist_backend):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        backend.seed(0)
        (model,), info = load_model_chunks(checkpoint=args.model, layout=Layout(), params_dtype=dtype,
                                           parallel_output=False, attention=args.attention)
        model.eval()
        calls = []  # the packed_seq_params of each model call: THD engaged where it is given
        model.register_forward_pre_hook(lambda module, a, kw: calls.append(kw.get("packed_seq_params")),
                                        with_kwargs=True)
        vocab_size = info.settings.vocab_size
        figures = {"layers": "transformer_engine" if any("transformer_engine" in type(m).__module__
                                                         for m in model.modules()) else "local"}
        for packed in (True, False):
            examples = build_examples(data=DataSpec(path=str(args.data), packing=packed), model_path=str(args.model),
                                      seq_length=args.seq_length, vocab_size=vocab_size, seed=0)
            figures["packed" if packed else "unpacked"] = record_figures(model, examples, vocab_size=vocab_size,
                                                                        device=backend.device)
            if packed:
                figures["thd_calls"] = sum(p is not None and getattr(p, "qkv_format", None) == "thd" for p in calls)
                figures["packed_calls"] = len(calls)
                figures["control"] = record_figures(model, examples, vocab_size=vocab_size, device=backend.device,
                                                    hide_boundaries=True)
    return figures


def record_figures(model, examples, *, vocab_size: int, device, hide_boundaries: bool = False,
                   micro: int = 2) -> list:
    import torch

    from gpu_numerics import record_losses
    from toolkit.train.engine.tasks import CausalLM

    task = CausalLM(vocab_size=vocab_size)
    records = []
    for start in range(0, len(examples), micro):
        rows = torch.arange(start, min(start + micro, len(examples)))
        ids, loss_mask, positions = examples.rows(rows)
        batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": loss_mask, "position_ids": positions}
        if hide_boundaries:
            batch["position_ids"] = torch.arange(positions.shape[1]).expand_as(positions).contiguous()
        on_device = {key: value.to(device) for key, value in batch.items()}
        with torch.no_grad():
            logits = task.forward(model, on_device)[..., :vocab_size].float()
            token_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), on_device["labels"].flatten(),
                                                           reduction="none").view_as(on_device["labels"])
        records += record_losses(token_loss.cpu(), loss_mask, positions)
    return records


def api(args) -> dict:
    """toolkit.api.initialize on the GPU with the script's own batches: one step's micro-batches evaluated as host
    tensors and as CUDA tensors (the same loss), then two train steps on CUDA batches, the second with its
    synchronising CUDA calls counted (`step_syncs`)."""
    import yaml

    sys.path.insert(0, str(REPO / "examples"))
    from own_loop import micro_batches, tokenise
    from transformers import AutoTokenizer

    from toolkit import api as dsmt_api
    from toolkit import backend as backends

    run = dsmt_api.initialize(yaml.safe_load(Path(args.spec).read_text()))
    rows = tokenise(args.data, tokenizer=AutoTokenizer.from_pretrained(run.model_dir),
                    seq_length=run.layout.seq_length)
    device = backends.current().device  # this rank's GPU (the CPU where the program is tried without one)

    def batches(step: int, *, cuda: bool) -> list[dict]:
        found = list(micro_batches(rows, run=run, step=step))
        return [{k: v.to(device) for k, v in b.items()} for b in found] if cuda else found

    figures = {"cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
               "eval_host": run.eval_step(batches(0, cuda=False)), "eval_cuda": run.eval_step(batches(0, cuda=True))}
    figures["train"] = [run.train_step(iter(batches(0, cuda=True)))]
    second, figures["step_syncs"] = counted_syncs(run.hybrid, lambda: run.train_step(iter(batches(1, cuda=True))))
    figures["train"].append(second)
    run.close()
    return figures


SYNC_MESSAGE = "synchroniz"  # torch's sync debug mode: "called a synchronizing CUDA operation"


def counted_syncs(hybrid, step, *, set_mode=None, shown: int = 5) -> tuple:
    """(`step()`'s result, the synchronising CUDA calls made inside the engine's step): torch's sync debug mode
    ("warn": a warning per host-device synchronisation) is on from the entry of `hybrid.train_step` to the entry
    of its `_step_stats`, where the step's values are read back on purpose. So neither the HF batch checks before
    the engine's step (toolkit/train/engine/hf_batches.py reads device batches value by value) nor that read-back
    count. {"count", "toolkit" (warned from a file under toolkit/), "elsewhere", "first": ["file:line", ...]}.
    Counted through Python's warnings (torch turns its C++ warning into one where a Python call reached it, and
    replays the backward's at its end); a C++ extension's own call that syncs warns on stderr instead (the log)."""
    import warnings

    if set_mode is None:
        import torch

        set_mode = torch.cuda.set_sync_debug_mode
    train_step, step_stats = hybrid.train_step, hybrid._step_stats  # bound methods

    def counted_train_step(*args, **kwargs):
        set_mode("warn")
        try:
            return train_step(*args, **kwargs)
        finally:
            set_mode("default")

    def uncounted_step_stats(*args, **kwargs):
        set_mode("default")
        return step_stats(*args, **kwargs)

    hybrid.train_step, hybrid._step_stats = counted_train_step, uncounted_step_stats  # instance attributes
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = step()
    finally:
        del hybrid.train_step, hybrid._step_stats  # the class's methods again
        set_mode("default")
    syncs = [w for w in caught if SYNC_MESSAGE in str(w.message)]
    import toolkit as package

    toolkit = str(Path(package.__file__).resolve().parent) + os.sep
    ours = [str(Path(w.filename).resolve()).startswith(toolkit) for w in syncs]
    sites = [f"{_short(w.filename)}:{w.lineno}" for w in syncs]
    return result, {"count": len(syncs), "toolkit": sum(ours), "elsewhere": len(syncs) - sum(ours),
                    "first": list(dict.fromkeys(sites))[:shown]}


def _short(filename: str) -> str:
    """A call site's file: relative to the repository, or from its package in site-packages."""
    path = Path(filename).resolve()
    if path.is_relative_to(REPO) and ".venv" not in path.parts:
        return str(path.relative_to(REPO))
    parts = path.parts
    return str(Path(*parts[parts.index("site-packages") + 1:])) if "site-packages" in parts else filename


def lora_peft(args) -> dict:
    """`dsmt train` of a LoRA spec (its init_adapter: PEFT's own, B != 0), then the one-process HF + PEFT reference
    of tests/train/reference_lora.py on the CPU in fp32 from the same adapter, data order and schedule."""
    import math

    import yaml

    from gpu_numerics import read_steps

    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}  # fp32 GEMMs in fp32 (TE's obey this, not torch's switches)
    train_dsmt(args.spec, env=env)
    sys.path.insert(0, str(REPO / "tests" / "train"))
    from reference_lora import train_lora_reference

    reference = train_lora_reference(Path(args.spec))
    output_dir = Path(yaml.safe_load(Path(args.spec).read_text())["training"]["output_dir"])
    rows = read_steps(output_dir)
    return {"dsmt": {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]},
            "reference": {"loss": reference.losses, "grad_norm": [float(n) for n in reference.grad_norms]},
            "finite": all(math.isfinite(r["loss"]) for r in rows)}


def resume(args) -> dict:
    """A copy of the finished run `args.source` cut back to its step-`args.step` checkpoint (later checkpoints,
    exports dropped: what a run preempted after that step leaves), then `dsmt train` of `args.spec` (whose
    output_dir is the copy) resumes it. tests/train/checkpoint/test_train_reshard.py cuts back the same way."""
    import yaml

    from toolkit.train.checkpoint.checkpoints import LATEST, tag_for

    target = Path(yaml.safe_load(Path(args.spec).read_text())["training"]["output_dir"])
    shutil.rmtree(target, ignore_errors=True)
    # the exports and the finished run's lock (toolkit/launch/run_lock.py) stay behind: the copy is a new run's
    shutil.copytree(args.source, target, ignore=shutil.ignore_patterns("final-*", ".dsmt-run.lock*"))
    for tag in (target / "checkpoints").glob("step_*"):
        if int(tag.name[len("step_"):]) > args.step:
            shutil.rmtree(tag)
    (target / "checkpoints" / LATEST).write_text(tag_for(args.step))
    train_dsmt(args.spec, env=dict(os.environ))
    return {"resumed_from": args.step}


def train_dsmt(spec: str | Path, *, env: dict) -> None:
    """`dsmt train --config spec` as a child of this process (in the case's process group); its output goes to
    this process's (the case log)."""
    sys.stdout.flush()
    done = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", "--config", str(spec)], cwd=REPO, env=env)
    if done.returncode != 0:
        raise SystemExit(f"dsmt train --config {spec} exited with {done.returncode}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("toolchain", "verify", "packing", "api", "lora-peft", "resume"):
        command = commands.add_parser(name)
        command.add_argument("--out", type=Path, required=True)
        if name == "verify":
            command.add_argument("checkpoints", type=Path, nargs="+")
            command.add_argument("--tp", type=int, default=1)
            command.add_argument("--pp", type=int, default=1)
            command.add_argument("--seq-len", type=int, default=32)
            command.add_argument("--timeout-s", type=float, default=600.0)
        if name == "packing":
            command.add_argument("--model", type=Path, required=True)
            command.add_argument("--data", type=Path, required=True)
            command.add_argument("--seq-length", type=int, default=128)
            command.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
            command.add_argument("--attention", choices=("fused", "local"), default="fused")
        if name in ("api", "lora-peft", "resume"):
            command.add_argument("--spec", type=Path, required=True)
        if name == "api":
            command.add_argument("--data", type=Path, required=True)
            command.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
        if name == "resume":
            command.add_argument("--source", type=Path, required=True)
            command.add_argument("--step", type=int, required=True)
    return parser.parse_args(argv)


PROGRAMS = {"toolchain": toolchain, "verify": verify, "packing": packing, "api": api, "lora-peft": lora_peft,
            "resume": resume}


def main(argv=None) -> int:
    args = parse_args(argv)
    figures = PROGRAMS[args.command](args)
    if args.command != "api" or int(os.environ.get("RANK", "0")) == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "scripts")]
    sys.exit(main())
