"""The verdicts of scripts/gpu_cases.py's cases: each reads what its case wrote (metrics.jsonl, a result JSON, the
log), compares it with scripts/gpu_numerics.py's bounds and returns the result line's detail, or raises
CaseFailed with the numbers that broke a bound."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gpu_numerics as numerics
import gpu_specs as specs
from gpu_runner import CaseFailed

# Verify's families whose sliding window the 32 compared tokens must reach past (the window itself compared).
WINDOWED = ("mistral", "gemma3_text")


class Verdicts:
    """Mixed into gpu_cases.Plan: `self.path(kind, name)` locates a case's files."""

    def path(self, kind: str, name: str) -> Path:
        raise NotImplementedError

    def result(self, name: str):
        return json.loads(self.path("result", name).read_text())

    def steps(self, name: str) -> list[dict]:
        return numerics.read_steps(self.path("run", name))

    def check_toolchain(self) -> str:
        facts = self.result("toolchain")
        done = [f"{name} {facts[name]} ({facts[name + '_s']:.1f} s)" for name in ("transformer_engine", "fused_adam",
                                                                                  "compile") if name in facts]
        line = f"{facts['gpus']} x {facts['gpu']}; " + "; ".join(done)
        if facts["errors"]:
            raise CaseFailed(line + "; FAILED: " + "; ".join(f"{k}: {v}" for k, v in facts["errors"].items()))
        return line

    def check_dry_run(self):
        found = self.result("dry-run")
        failed = {name: item["errors"] for name, item in found.items() if not item["ok"]}
        if failed:
            raise CaseFailed("; ".join(f"{name}: {errors}" for name, errors in failed.items()))
        return f"{len(found)} specs pass", [f"{name}: {fusions_short(item['fusions'])}" for name, item in found.items()]

    def check_finite(self, name: str, *, steps: int = specs.TRAIN_STEPS) -> str:
        rows = self.steps(name)
        finite = numerics.finite_losses(rows, expected_steps=steps)
        if not finite.ok:
            raise CaseFailed(finite.detail)
        return f"{finite.detail}; {numerics.warmup_text(rows)}"

    def compare(self, comparison: numerics.Comparison, *, also: str = "") -> str:
        if not comparison.ok:
            raise CaseFailed(comparison.detail)
        return comparison.detail + also

    def check_te_vs_local(self) -> str:
        te, local = (numerics.step_losses(self.steps(name)) for name in ("te-bf16", "local-bf16"))
        later = max(numerics.rel_diff(a, b) for a, b in zip(te[1:], local[1:]))
        return self.compare(numerics.compare_series("step-1 loss TE/local", te[:1], local[:1],
                                                    rel=numerics.TE_VS_LOCAL_REL), also=f"; steps 2-4 rel {later:.1e}")

    def check_zero(self, name: str) -> str:
        return self.compare(numerics.compare_series(f"loss {name}/zero1", numerics.step_losses(self.steps(name)),
                                                    numerics.step_losses(self.steps("te-bf16")),
                                                    rel=numerics.ZERO_VS_ZERO1_REL))

    def check_fp16(self) -> str:
        self.check_finite("fp16")
        fp16, bf16 = (numerics.step_losses(self.steps(name), steps=[1]) for name in ("fp16", "te-bf16"))
        return self.compare(numerics.compare_series("step-1 loss fp16/bf16", fp16, bf16,
                                                    rel=numerics.FP16_VS_BF16_REL))

    def resumed_steps(self, name: str) -> tuple[list[float], list[float]]:
        after = list(range(specs.RESUME_STEP + 1, specs.TRAIN_STEPS + 1))
        return (numerics.step_losses(self.steps(name), steps=after),
                numerics.step_losses(self.steps("te-bf16"), steps=after))

    def check_resume(self) -> str:
        return self.compare(numerics.compare_resumed("steps 3-4 loss resumed/uninterrupted",
                                                     *self.resumed_steps("resume")))

    def check_reshard(self) -> str:
        return self.compare(numerics.compare_series("steps 3-4 loss zero1->zero3/uninterrupted",
                                                    *self.resumed_steps("reshard-zero3"), rel=numerics.RESHARD_REL))

    def check_lora(self, name: str, precision: str) -> str:
        found = self.result(name)
        loss_rel = numerics.LORA_FP32_REL if precision == "fp32" else numerics.LORA_BF16_LOSS_REL
        grad_rel = numerics.LORA_FP32_REL if precision == "fp32" else numerics.LORA_BF16_GRAD_REL
        loss = numerics.compare_series("loss dsmt/PEFT", found["dsmt"]["loss"], found["reference"]["loss"],
                                       rel=loss_rel)
        norm = numerics.compare_series("grad norm", found["dsmt"]["grad_norm"][:1],
                                       found["reference"]["grad_norm"][:1], rel=grad_rel)
        if not (loss.ok and norm.ok):
            raise CaseFailed(f"{loss.detail}; step-1 {norm.detail}")
        return f"{precision}: {loss.detail}; step-1 {norm.detail}"

    def check_packing(self) -> str:
        found = self.result("packing-thd")
        bound = numerics.PACKED_VS_UNPACKED_ABS
        same = numerics.compare_records(found["packed"], found["unpacked"], abs_tol=bound)
        control = numerics.compare_records(found["control"], found["unpacked"], abs_tol=bound)
        thd = f"THD in {found['thd_calls']} of {found['packed_calls']} packed calls ({found['layers']} layers)"
        problems = [same.detail] if not same.ok else []
        if found["layers"] == "transformer_engine" and found["thd_calls"] == 0:
            problems.append("Transformer Engine's attention never took the THD layout")
        if control.worst <= bound:  # the comparison could not tell records that see each other
            problems.append(f"the control (boundaries hidden) is within the bound too: {control.worst:.1e}")
        if problems:
            raise CaseFailed("; ".join(problems + [thd]))
        return f"{same.detail}; {thd}; control {control.worst:.1e} > {bound:g}"

    def check_verify(self, name: str) -> str:
        results = self.result(name)["results"]
        failed = [f"{r['model_type']} {r['max_abs_diff']:.1e} > {r['tolerance']:g}" for r in results if not r["passed"]]
        not_te = [r["model_type"] for r in results if r.get("layers") != "transformer_engine"]
        windows = [r["model_type"] for r in results if "reaches past" in (r.get("window") or "")]
        inside = [family for family in WINDOWED if family not in windows]
        problems = failed + ([f"not on TE layers: {not_te}"] if not_te else [])
        problems += [f"{family}: the window was not reached (seq_len inside it)" for family in inside]
        if problems:
            raise CaseFailed("; ".join(problems))
        worst = max(results, key=lambda r: r["max_abs_diff"])
        return (f"{len(results)} families on TE layers, max|dlogits| {worst['max_abs_diff']:.1e} "
                f"({worst['model_type']}) <= {worst['tolerance']:g}; past the window: {', '.join(windows) or 'none'}")

    def check_api(self) -> str:
        found = self.result("api-cuda")
        host, cuda = found["eval_host"]["loss"], found["eval_cuda"]["loss"]
        same = numerics.compare_series("eval loss host/CUDA batches", [cuda], [host],
                                       rel=numerics.API_HOST_VS_DEVICE_REL)
        first = numerics.compare_series("step-1 train/eval loss", [found["train"][0]["loss"]], [cuda],
                                        rel=numerics.API_TRAIN_VS_EVAL_REL)
        losses = [step["loss"] for step in found["train"]]
        if not (same.ok and first.ok and all(math.isfinite(loss) for loss in losses)):
            raise CaseFailed(f"{same.detail}; {first.detail}; train losses {losses}")
        return (f"{same.detail}; {first.detail}; CUDA_DEVICE_MAX_CONNECTIONS="
                f"{found['cuda_device_max_connections']}; {syncs_text(found.get('step_syncs'))}")

    def check_timing(self, run: Path, plan: numerics.DiskPlan) -> str:
        """The timed steps finite (without a save: the first TIMING_STEPS of the steps logged before the SIGKILL,
        and nothing saved); the save's size and seconds where there was one."""
        rows = numerics.read_steps(run)
        logged = len(rows)
        if not plan.save:
            rows = rows[:specs.TIMING_STEPS]
        finite = numerics.finite_losses(rows, expected_steps=specs.TIMING_STEPS)
        if not finite.ok:
            raise CaseFailed(finite.detail)
        saved = numerics.save_seconds(self.path("log", "timing-1b").read_text(errors="replace"))
        if plan.save:
            save = f"save {saved[0]}: {saved[1]:,.0f} MB in {saved[2]:.1f} s" if saved else "no checkpoint line in the log"
            return f"{numerics.warmup_text(rows)}; {save}"
        checkpoints = run / "checkpoints"
        written = sorted(path.name for path in checkpoints.iterdir()) if checkpoints.is_dir() else []
        if saved or any(name.startswith("step_") for name in written):
            raise CaseFailed(f"the disk cannot hold a save, yet one was written ({saved or written}): {plan.reason}")
        return (f"{numerics.warmup_text(rows)}; no save: {plan.reason} (SIGKILLed after {logged} steps logged of "
                f"{specs.TIMING_STEPS + specs.TIMING_SPARE_STEPS}, before its last step's save)")


def syncs_text(syncs: dict | None) -> str:
    """The api-cuda line's count of synchronising CUDA calls in step 2 (shown, not judged: DeepSpeed's optimizer
    step reads its overflow flag and gradient norm back by design)."""
    if not syncs:
        return "host syncs in step 2: not counted"
    first = f": {', '.join(syncs['first'])}" if syncs["first"] else ""
    return (f"host syncs in step 2 (engine train_step .. _step_stats): {syncs['count']} ({syncs['toolkit']} from "
            f"toolkit/, {syncs['elsewhere']} elsewhere){first}")


def fusions_short(message: str) -> str:
    """The dry run's fusions line without its explanation: which layers, which fused kernels on and off."""
    found = re.search(r"(Transformer Engine|local) layers.*?fused kernels on: ([^;]*); off: ([^(]*)", message)
    return f"{found[1]} layers, fused: {found[2]}; unfused: {found[3].strip()}" if found else message
