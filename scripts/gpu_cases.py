"""The GPU paths no CPU test can run, checked for right numbers, not only for no crash (scripts/gpu_check.sh runs
them on the first GPU lent). Tiny models built on the spot, nothing downloaded.

    python scripts/gpu_cases.py WORK [--with-timing] [--jobs 3] [--budget-s 390] [--started-at EPOCH_S]
                                     [--only NAME,...]
    python scripts/gpu_cases.py WORK --dry-run     # build every case's inputs, dry-run every spec (the CPU test)
    python scripts/gpu_cases.py --outer-timeout [--budget-s 390] [--started-at EPOCH_S]   # gpu_check.sh's bound

One line per case as it ends, each case in its own process group with its own timeout (scripts/gpu_runner.py);
the bounds and why they are what they are: scripts/gpu_numerics.py.

  toolchain        TE's import, DeepSpeed's FusedAdam (prebuilt or JIT-built) and megatron's torch.compile'd
                   bias-SwiGLU, each timed: what a run's first step builds
  dry-run          every spec through `dsmt train --dry-run`'s checks; the fusions each run turns on
  verify-te        `dsmt verify` of Llama, Qwen3, Mistral past its window, Gemma 3 (two RoPEs), Phi-3 long-RoPE,
                   DeepSeek-V2 (MLA) and GPT-2 in ONE launch on TE's layers, fp32 with TF32 off: max|dlogits| <= 1e-4
  verify-tp2-pp2   the same at TP2 x PP2 (4 GPUs or more)
  packing-thd      per-record losses of packed rows (THD on TE's attention) against unpacked ones, bf16: each record's
                   mean within 3e-2, THD engaged, and the control (boundaries hidden) outside that bound
  te-bf16          `dsmt train`, TE layers, bf16, packed stories, 4 steps, checkpoints at 2 and 4; compile seconds
  local-bf16       the same on megatron's local layers;   te-vs-local: step 1's loss, rel <= 2e-2
  zero2, zero3     te-bf16 at ZeRO-2 / ZeRO-3 (TE modules under zero.Init): every step rel <= 1e-3 of ZeRO-1's
  fp16             te-bf16 in fp16 (loss scaling): step 1 rel <= 2e-2 of bf16's
  resume           te-bf16 cut back to its step-2 checkpoint, resumed at the same layout: step 3 bit-exact (the
                   restored weights' forward), step 4 bit-exact or rel <= 1e-3 (TE's default backward uses atomics)
  reshard-zero3    the same checkpoint resumed at ZeRO-3 (resharded optimizer state): steps 3-4 rel <= 5e-3
  lora-peft-llama  LoRA on TE's layers against HF + PEFT (tests/train/reference_lora.py), fp32, TF32 off: loss and
                   gradient norm at steps 1-2 rel <= 1e-4
  lora-peft-gpt2   GPT-2 (TE returns (out, bias, ln_out)), bf16 against the fp32 reference: loss 2e-2, norm 5e-2
  moe-aux          Mixtral with its load-balancing loss;   plain-gpt-neox: a model without an adapter (finite losses)
  api-cuda         toolkit.api.initialize under torchrun, CUDA batches: the same loss as host batches (rel 1e-6),
                   step 1's loss as the eval step's on its batches (rel 1e-3); CUDA_DEVICE_MAX_CONNECTIONS shown;
                   the synchronising CUDA calls of step 2 counted (shown, not judged: DeepSpeed's step syncs)
  timing-1b        (--with-timing) 20 bf16 steps of llama3.2-1b alone on the GPU; its save timed where the disk holds
                   it (else SIGKILLed once step 20 is logged, long before its only save); host peak memory
                   (scripts/gpu_check.sh prints the table)

The budget (--budget-s, counted from --started-at: gpu_check.sh's own start, so its versions block and the cases'
inputs built here count) decides which cases start; every case still running HARD_SLACK_S after it is killed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import signal
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(SCRIPTS.parent), str(SCRIPTS)) if p not in sys.path]

import gpu_numerics as numerics  # noqa: E402
import gpu_specs as specs  # noqa: E402
from gpu_runner import Case, outer_timeout_s, run_cases, summary  # noqa: E402
from gpu_verdicts import Verdicts  # noqa: E402

NO_TE = "Transformer Engine is not importable here (pip install transformer-engine[pytorch])"
BUDGET_S = 390.0  # gpu_check.sh's default: with the runner's HARD_SLACK_S, a kill's grace and REPORT_S, <= 8 min
SETUP_S = 30  # expected: gpu_check.sh's versions block, then Plan.cases() (11 tiny checkpoints, 2 PEFT adapters)
REPORT_S = 20  # expected: gpu_check.sh's measured-vs-planned table and its cleanup, after the runner
# Per case: (expected seconds on one H100 with `--jobs 3` cases at once, timeout in seconds). The timeout kills the
# case's process group; the expected seconds decide whether it still starts inside the run's budget (SETUP_S, then
# their sum over a one-GPU machine's cases divided by the cases at once, then the timing run: within BUDGET_S).
# A tiny model's `dsmt train` is mostly start-up: the launcher's checks, then a rank importing torch, megatron-core,
# DeepSpeed and TE (~20 s), building and compiling (the first step), saving and exporting.
TIMES = {
    "toolchain": (60, 300),  # DeepSpeed's FusedAdam JIT build when it is not prebuilt: ~60 s cold
    "dry-run": (30, 150),
    "verify-te": (60, 300), "verify-tp2-pp2": (60, 300),  # 7 HF models loaded beside megatron's
    "te-bf16": (45, 240), "local-bf16": (40, 180), "te-vs-local": (0, 0),
    "packing-thd": (30, 150),
    "lora-peft-llama": (50, 240),  # `dsmt train`, then the HF + PEFT reference on the CPU
    "zero3": (45, 180), "zero2": (40, 180), "fp16": (40, 180),
    "resume": (40, 180), "reshard-zero3": (45, 180),
    "api-cuda": (40, 180), "lora-peft-gpt2": (50, 240), "moe-aux": (40, 180), "plain-gpt-neox": (35, 150),
    # 1.24B parameters: start-up and build (~35 s), 20 steps with the first's compile (~25 s), a ~15 GB
    # checkpoint (~20 s) and the export (~25 s)
    "timing-1b": (120, 300),
}


def times(name: str) -> dict:
    budget_s, timeout_s = TIMES[name]
    return {"budget_s": budget_s, "timeout_s": timeout_s}


@dataclasses.dataclass(frozen=True)
class Machine:
    transformer_engine: bool
    gpus: int
    free_bytes: int  # on WORK's filesystem

    @classmethod
    def here(cls, work: Path) -> "Machine":
        import torch

        return cls(importlib.util.find_spec("transformer_engine") is not None, torch.cuda.device_count(),
                   shutil.disk_usage(work).free)


DRY_MACHINE = Machine(transformer_engine=True, gpus=4, free_bytes=10**13)  # the dry run builds every case


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


class Plan(Verdicts):
    """The cases for one WORK directory on one machine: their inputs written, their checks bound to their files."""

    def __init__(self, work: Path, machine: Machine, *, gpu_preset: str = "h100-80gb"):
        self.work, self.machine, self.gpu_preset = work, machine, gpu_preset
        self.te = None if machine.transformer_engine else NO_TE

    def path(self, kind: str, name: str) -> Path:
        return self.work / {"spec": "specs", "run": "runs", "result": "results", "log": "logs"}[kind] / (
            name + {"spec": ".yaml", "run": "", "result": ".json", "log": ".log"}[kind])

    def checks(self, command: str, name: str, *args: str) -> list[str]:
        return python(str(SCRIPTS / "gpu_checks.py"), command, "--out", str(self.path("result", name)), *args)

    def train(self, name: str, fields: dict, *, check, needs=(), env=None, skip=None) -> Case:
        spec_path = specs.write(self.path("spec", name), fields)
        return Case(name, python("-m", "toolkit.cli", "train", "--config", str(spec_path)), check=check, needs=needs,
                    after=("toolchain",), env=dict(env or {}), skip=skip, **times(name))

    # --- the cases, in the order they may start (the first ones matter most) ------------------------------------

    def cases(self, *, with_timing: bool) -> list[Case]:
        models = specs.models(self.work)
        found = [Case("toolchain", self.checks("toolchain", "toolchain"), check=self.check_toolchain,
                      **times("toolchain")),
                 Case("dry-run", python(str(SCRIPTS / "gpu_cases.py"), str(self.work), "--dry-run", "--json",
                                        str(self.path("result", "dry-run"))), check=self.check_dry_run,
                      **times("dry-run"))]
        found += self.verify_cases()
        found += self.training_cases(models["llama"])
        found += self.other_cases(models)
        if with_timing:
            found.append(self.timing_case())
        return found

    def verify_cases(self) -> list[Case]:
        checkpoints = [str(path) for path in specs.verify_models(self.work)]
        found = []
        for name, tp, pp in (("verify-te", 1, 1), ("verify-tp2-pp2", 2, 2)):
            skip = self.te or (f"needs {tp * pp} GPUs, this node has {self.machine.gpus}"
                               if self.machine.gpus < tp * pp else None)
            found.append(Case(name, self.checks("verify", name, "--tp", str(tp), "--pp", str(pp), *checkpoints),
                              check=lambda name=name: self.check_verify(name), skip=skip, **times(name)))
        return found

    def training_cases(self, llama: Path) -> list[Case]:
        env, te, first = specs.DETERMINISTIC_ENV, self.te, ("te-bf16",)

        def llama_spec(name: str, **options) -> dict:
            return specs.spec(model_dir=llama, output_dir=self.path("run", name), **options)

        documents = specs.short_documents(self.work / "data" / "documents.jsonl")
        return [
            self.train("te-bf16", llama_spec("te-bf16"), check=lambda: self.check_finite("te-bf16"), env=env, skip=te),
            self.train("local-bf16", llama_spec("local-bf16", training={"attention": "local"}),
                       check=lambda: self.check_finite("local-bf16"), env=env),
            Case("te-vs-local", None, check=self.check_te_vs_local, needs=("te-bf16", "local-bf16")),
            Case("packing-thd", self.checks("packing", "packing-thd", "--model", str(llama), "--data", str(documents)),
                 check=self.check_packing, skip=te, **times("packing-thd")),
            self.lora_case("lora-peft-llama", model_dir=llama, precision="fp32", seed=11),
            *[self.train(f"zero{stage}", llama_spec(f"zero{stage}", zero_stage=stage), needs=first, env=env,
                         check=lambda stage=stage: self.check_zero(f"zero{stage}"), skip=te) for stage in (3, 2)],
            self.train("fp16", llama_spec("fp16", precision="fp16"), check=self.check_fp16, needs=first, env=env,
                       skip=te),
            self.resume_case("resume", llama_spec("resume"), check=self.check_resume),
            self.resume_case("reshard-zero3", llama_spec("reshard-zero3", zero_stage=3), check=self.check_reshard),
        ]

    def resume_case(self, name: str, fields: dict, *, check) -> Case:
        spec_path = specs.write(self.path("spec", name), fields)
        command = self.checks("resume", name, "--spec", str(spec_path), "--source", str(self.path("run", "te-bf16")),
                              "--step", str(specs.RESUME_STEP))
        return Case(name, command, check=check, needs=("te-bf16",), env=dict(specs.DETERMINISTIC_ENV), skip=self.te,
                    **times(name))

    def lora_case(self, name: str, *, model_dir: Path, precision: str, seed: int) -> Case:
        adapter = specs.peft_adapter(model_dir, self.work / "models" / f"{name}-adapter", seed=seed)
        fields = specs.lora_spec(model_dir=model_dir, adapter=adapter, output_dir=self.path("run", name),
                                 precision=precision)
        spec_path = specs.write(self.path("spec", name), fields)
        return Case(name, self.checks("lora-peft", name, "--spec", str(spec_path)), after=("toolchain",),
                    check=lambda: self.check_lora(name, precision), skip=self.te, **times(name))

    def other_cases(self, models: dict[str, Path]) -> list[Case]:
        api = specs.write(self.path("spec", "api-cuda"), specs.api_spec(
            model_dir=models["llama"], output_dir=self.path("run", "api-cuda"),
            attention="local" if self.te else "fused"))
        command = python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                         str(SCRIPTS / "gpu_checks.py"), "api", "--out", str(self.path("result", "api-cuda")),
                         "--spec", str(api), "--data", str(specs.STORIES))
        mixtral = specs.spec(model_dir=models["mixtral"], output_dir=self.path("run", "moe-aux"))
        neox = specs.spec(model_dir=models["gpt-neox"], output_dir=self.path("run", "plain-gpt-neox"))
        return [Case("api-cuda", command, check=self.check_api, after=("toolchain",), **times("api-cuda")),
                self.lora_case("lora-peft-gpt2", model_dir=models["gpt2"], precision="bf16", seed=12),
                self.train("moe-aux", mixtral, check=lambda: self.check_finite("moe-aux"), skip=self.te),
                self.train("plain-gpt-neox", neox, check=lambda: self.check_finite("plain-gpt-neox"))]

    def timing_case(self) -> Case:
        """Where the disk cannot hold the save, the run (spare steps, its only save at its last: timing_spec) is
        SIGKILLed by the runner once the timed steps are logged, and on a timeout too: a SIGTERM would make dsmt
        save a checkpoint at the next step boundary (toolkit/train/job/preemption.py)."""
        run = self.work / "train-1b"
        plan = numerics.timing_disk_plan(free_bytes=self.machine.free_bytes, params=specs.timing_params())
        spec_path = specs.write(self.path("spec", "timing-1b"),
                                specs.timing_spec(output_dir=run, gpu=self.gpu_preset, save=plan.save))

        def timed_steps_logged() -> bool:
            metrics = run / "metrics.jsonl"
            return metrics.is_file() and len(metrics.read_text().splitlines()) >= specs.TIMING_STEPS

        return Case("timing-1b", python("-m", "toolkit.cli", "train", "--config", str(spec_path)), last=True,
                    check=lambda: self.check_timing(run, plan), stop_when=None if plan.save else timed_steps_logged,
                    kill_at_once=not plan.save, **times("timing-1b"))


# --- the dry run ---------------------------------------------------------------------------------------------------

def dry_run_all(work: Path) -> dict[str, dict]:
    """Every spec under WORK/specs through `dsmt train --dry-run`'s checks in this process, and every verify
    checkpoint through what run_verify_many checks before it launches."""
    from toolkit.check.dryrun import dry_run
    from toolkit.convert.chunks import check_layout, inspect_checkpoint
    from toolkit.verify.worker import verify_layout

    found = {}
    for path in sorted((work / "specs").glob("*.yaml")):
        report = dry_run(path)
        errors = [f"[{p.rule}] {p.message}" for p in report.problems if p.severity == "error"]
        fusions = next((p.message for p in report.problems if p.rule == "fusions"), "no fusions line")
        found[path.stem] = {"ok": not errors, "errors": errors, "fusions": fusions}
    for checkpoint in sorted((work / "models" / "verify").iterdir()):
        info = inspect_checkpoint(checkpoint)
        for tp, pp in ((1, 1), (2, 2)):
            check_layout(hf_config=info.hf_config, layout=verify_layout(tp=tp, pp=pp, vpp=1, ep=1),
                         vocab_pad_multiple=info.vocab_pad_multiple)
    return found


def selected(cases: list[Case], only: str | None) -> list[Case]:
    """The cases named in `only` (comma-separated) and the cases they need."""
    if not only:
        return cases
    by_name, wanted = {case.name: case for case in cases}, set()
    stack = [name.strip() for name in only.split(",") if name.strip()]
    while stack:
        name = stack.pop()
        if name not in by_name:
            raise SystemExit(f"--only: no case {name!r}; cases: {', '.join(by_name)}")
        wanted.add(name)
        stack += [need for need in by_name[name].needs if need not in wanted]
    return [case for case in cases if case.name in wanted]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, nargs="?")
    parser.add_argument("--dry-run", action="store_true", help="build every case's inputs and dry-run every spec")
    parser.add_argument("--json", type=Path, help="--dry-run: write what it found here")
    parser.add_argument("--with-timing", action="store_true", help="add the llama3.2-1b timing run (last, alone)")
    parser.add_argument("--jobs", type=int, default=3, help="cases at once on the GPU (tiny models share it)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="no case starts that would end past this many seconds after --started-at")
    parser.add_argument("--started-at", type=float, default=None,
                        help="the run's start, epoch seconds (`date +%%s`; default: now): the budget counts from it")
    parser.add_argument("--only", help="comma-separated case names (and what they need)")
    parser.add_argument("--outer-timeout", action="store_true",
                        help="print gpu_check.sh's bound on this runner, in seconds from now, and exit")
    return parser.parse_args(argv)


def spent_s(started_at: float | None) -> float:
    """Seconds since `started_at` (epoch seconds; None: none)."""
    return 0.0 if started_at is None else max(time.time() - started_at, 0.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.outer_timeout:
        print(outer_timeout_s(budget_s=args.budget_s, spent_s=spent_s(args.started_at)))
        return 0
    if args.work is None:
        raise SystemExit("gpu_cases.py: WORK is required")
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        if not (work / "specs").is_dir():  # the GPU run's own dry-run case finds the specs written already
            Plan(work, DRY_MACHINE).cases(with_timing=True)
        found = dry_run_all(work)
        for name, item in found.items():
            print(f"{'ok' if item['ok'] else 'FAIL'} {name}: {'; '.join(item['errors']) or item['fusions']}",
                  flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(found))
        return 0 if all(item["ok"] for item in found.values()) else 1
    # gpu_check.sh's outer timeout sends SIGTERM: unwind, so that the runner stops every running case's group
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    plan = Plan(work, Machine.here(work), gpu_preset=specs.gpu_preset())
    cases = selected(plan.cases(with_timing=args.with_timing), args.only)
    outcomes = run_cases(cases, log_dir=work / "logs", cwd=SCRIPTS.parent, jobs=args.jobs, budget_s=args.budget_s,
                         spent_s=spent_s(args.started_at))
    print(f"gpu_cases: {summary(outcomes)} ({work})", flush=True)
    return 1 if any(outcome.status == "FAIL" for outcome in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
