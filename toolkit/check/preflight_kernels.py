"""`dsmt preflight`'s verdicts on the GPU kernels each node reported (`toolkit.launch.preflight_probe.kernel_facts`):
Transformer Engine where the layers are TE's, DeepSpeed's fused Adam where it is the optimizer, and the
torch.compile that megatron's fused kernels run at the first step where the run uses them (training.fusions)."""

from __future__ import annotations

from toolkit.errors import Problem

RULE_COMPILE = "preflight_fused_compile"
WHAT_COMPILES = "torch.compile of a fused bias + SwiGLU, forward and backward (as megatron's fused kernels at step 1)"
OFF_FIX = ("or set training.fusions: off (megatron's unfused kernels; nothing compiles; the elementwise ops run "
           "slower)")


def kernel_problems(*, spec, answers: dict[str, dict]) -> list[Problem]:
    """GPU runs: Transformer Engine must import where the layers are TE's (training.attention fused, auto on
    cuda), and DeepSpeed's fused Adam must load where it is the optimizer (no optimizer offload)."""
    from toolkit.spec.layout import spec_attention

    if spec.cluster.device != "cuda":
        return []
    needs = {"transformer_engine": spec_attention(spec) == "fused",
             "fused_adam": not spec.parallel.offload_optimizer}
    fixes = {"transformer_engine": "install transformer-engine for this torch and CUDA on every node (the same "
                                   "environment), or set training.attention: local (slower, stores the s x s scores)",
             "fused_adam": "install a DeepSpeed built with DS_BUILD_FUSED_ADAM=1, or make nvcc and ninja available "
                           "for its JIT build (CUDA_HOME)"}
    problems = []
    for host, node in answers.items():
        kernels = node.get("kernels") or {}
        for name, needed in needs.items():
            if needed and kernels.get(name):
                problems.append(Problem("error", f"preflight_{name}", f"{host}: {kernels[name]}", fixes[name]))
    if answers and not problems:
        checked = [name for name, needed in needs.items() if needed]
        problems.append(Problem("info", "preflight_kernels", f"{len(answers)} node(s): "
                                f"{', '.join(checked) or 'no GPU kernels needed'} load"))
    return problems


def compile_problems(*, spec, answers: dict[str, dict]) -> list[Problem]:
    """GPU runs: an error per node where the probe's compile failed, when the run uses megatron's fused kernels
    (cluster.device cuda, training.fusions auto): without a C compiler, libcuda or Triton every rank fails at step 1.
    Otherwise one note with the compile's seconds (what each rank pays once, at the first step)."""
    if spec.cluster.device != "cuda":
        return []
    used = spec.training.fusions == "auto"
    reported = {host: (node.get("kernels") or {}).get("fused_compile") for host, node in answers.items()}
    reported = {host: facts for host, facts in reported.items() if facts and not facts.get("skipped")}
    failed = {host: facts for host, facts in reported.items() if facts.get("error")}
    ran = {host: facts["seconds"] for host, facts in reported.items() if not facts.get("error")}
    if used and failed:
        return [Problem("error", RULE_COMPILE, f"{host}: {compile_failure(facts)}", compile_fix(facts))
                for host, facts in failed.items()]
    notes = []
    if ran:
        slowest = max(ran, key=ran.get)
        notes.append(f"{len(ran)} node(s): {WHAT_COMPILES} took at most {ran[slowest]} s ({slowest})")
    if not used:
        notes.append("training.fusions: off: the run compiles nothing" + (
            f"; on {', '.join(failed)} the compile fails ({next(iter(failed.values()))['error']})" if failed else ""))
    return [Problem("info", RULE_COMPILE, "; ".join(notes))] if notes else []


def compile_failure(facts: dict) -> str:
    """The failure and each piece the compile needs, as the node found it."""
    headers = ", Python.h: missing" if facts.get("python_headers") is False else ""
    return (f"{WHAT_COMPILES} failed after {facts.get('seconds')} s: {facts['error']} (C compiler: "
            f"{facts.get('c_compiler') or 'none ($CC, gcc, clang)'}, libcuda: {facts.get('libcuda') or 'not found'}, "
            f"triton: {facts.get('triton') or 'not installed'}{headers})")


def compile_fix(facts: dict) -> str:
    """The missing pieces named, then the way around all of them."""
    steps = []
    if not facts.get("c_compiler"):
        steps.append("install a C compiler (apt install gcc) or point CC at one")
    if not facts.get("libcuda"):
        steps.append("make libcuda findable (TRITON_LIBCUDA_PATH=<folder of libcuda.so.1>, or run ldconfig)")
    if not facts.get("triton"):
        steps.append("install triton (the version this torch requires)")
    if facts.get("python_headers") is False:
        steps.append("install Python's headers (apt install python3-dev)")
    return (("; ".join(steps) if steps else "fix what the error names") + " on every node (variables such as CC or "
            f"TRITON_LIBCUDA_PATH for the ranks: communication.extra_env, which preflight applies too), {OFF_FIX}")
