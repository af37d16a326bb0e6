"""What real engines hold, rank by rank, next to what the planner predicts for that rank (tests and benchmark).

One launch runs many cases (imports cost ~6 s per process):

    python -m torch.distributed.run --nproc_per_node=N tests/plan/live_memory.py MODEL_DIR OUT_DIR CASES_JSON

and every rank writes OUT_DIR/rank{r}.json. A case is either
  * "states": a DeepSpeed engine built as `dsmt train` builds it (job spec -> ds_config -> load_model_chunks ->
    HybridEngine), trained two steps; the tensors it holds are classified by `live_tensors.classify`
    (toolkit-independent: parameters, gradients, optimizer, buffers) at the moments `live_tensors.Moments` samples, or
  * "activations": one megatron-core forward + loss of the chunk (no DeepSpeed), measured by `live_tensors`'
    saved-tensor hooks and live-storage tracker.
Every case carries the planner's figures for this rank's pipeline stage from the same job spec `dsmt check` reads
(`toolkit.check.checks.planner_inputs`).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

SEQ = 32
MICRO = 2


def job_spec(*, model_dir: str, tp: int, pp: int, dp: int, zero: int, precision: str, persistence: int,
             micro: int = MICRO, seq: int = SEQ, recompute: str = "none") -> dict:
    """The CPU job spec of a case: 2 micro-batches per step, small buckets so that they show next to the model."""
    communication = {"reduce_bucket_elements": 20_000, "allgather_bucket_elements": 20_000,
                     "prefetch_bucket_elements": 20_000, "param_persistence_threshold_elements": persistence}
    if precision == "bf16" and zero == 0:  # DeepSpeed has no fp32 accumulation without ZeRO (dsmt check says so)
        communication["grad_accum_dtype"] = "bf16"
    return {"model": {"path": model_dir},
            "cluster": {"nodes": 1, "gpus_per_node": tp * pp * dp, "gpu": "cpu", "device": "cpu",
                        "interconnect": "tcp"},
            "parallel": {"tp": tp, "pp": pp, "zero_stage": zero},
            "training": {"global_batch_size": 2 * micro * dp, "micro_batch_size": micro, "seq_length": seq,
                         "precision": precision, "recompute": recompute, "attention": "local", "lr": 1e-3,
                         "min_lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 0, "train_steps": 5},
            "communication": communication, "data": {"synthetic": True}}


def planner_figures(*, spec, stage: int, dp_rank: int) -> dict:
    """The planner's per-GPU figures for pipeline stage `stage` and data-parallel rank `dp_rank` of `spec`, with
    `dsmt check`'s inputs (the planner itself reports each stage's worst rank)."""
    from toolkit.plan.memory import stage_memory
    from toolkit.check.checks import planner_inputs
    from toolkit.spec.load import model_shape

    layout, training, _, assumptions = planner_inputs(spec)
    memory = stage_memory(shape=model_shape(spec.model), layout=layout, training=training, stage=stage,
                          assumptions=assumptions, dp_rank=dp_rank)
    overhead = int(assumptions.framework_overhead_gb * 1e9)
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer": memory.optimizer,
            "buffers": memory.buffers, "build_peak": memory.build_peak - overhead, "params": memory.params_per_gpu}


def _use_layout(*, tp: int, pp: int, dp: int) -> None:
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.parallel.groups import Layout, init_process_groups

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_process_groups(layout=Layout(tp=tp, pp=pp, dp=dp), dist_backend="gloo")
    backends.current().seed(7)


def random_batches(*, count: int, micro: int, seq: int, vocab: int, seed: int) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=generator)
        batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                        "loss_mask": torch.ones(micro, seq),
                        "position_ids": torch.arange(seq).expand(micro, seq).contiguous()})
    return batches


def states_case(case: dict, *, model_dir: str) -> dict:
    """Build the engine as `dsmt train` does, train two steps, return live and predicted bytes of this rank."""
    import torch
    from megatron.core import parallel_state

    from live_tensors import BuildTracker, Moments
    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import validate_spec
    from toolkit.train.engine.hybrid import HybridEngine

    spec = validate_spec(job_spec(model_dir=model_dir, **case), source="live_memory")
    layout = derive_layout(spec)
    _use_layout(tp=case["tp"], pp=case["pp"], dp=case["dp"])
    ds_config = build_deepspeed_config(spec=spec, layout=layout)
    dtype = torch.bfloat16 if case["precision"] == "bf16" else torch.float32
    with BuildTracker() as build:
        chunks, info = load_model_chunks(checkpoint=Path(model_dir), layout=Layout(tp=layout.tp, pp=layout.pp,
                                         dp=layout.dp), params_dtype=dtype,
                                         zero3_config=ds_config if case["zero"] == 3 else None)
    hybrid = HybridEngine(chunks=chunks, ds_config=ds_config, vocab_size=info.settings.vocab_size,
                          tied_embeddings=info.settings.tied_embeddings, pp_size=layout.pp)
    steps = [random_batches(count=layout.grad_accum_steps, micro=layout.micro_batch_size, seq=layout.seq_length,
                            vocab=info.settings.vocab_size, seed=step) for step in range(2)]
    hybrid.train_step(steps[0])  # creates the lazily allocated state (Adam moments, buckets)
    moments = Moments(hybrid.engine)
    hybrid.train_step(steps[1])
    moments.sample("after step")
    stage = parallel_state.get_pipeline_model_parallel_rank()
    result = {"case": case, "stage": stage, "optimizer_class": type(hybrid.engine.optimizer).__name__,
              "live": moments.peaks(), "moments": moments.samples, "unclassified": moments.unclassified(),
              "live_params": moments.param_count, "build_peak": build.peak_bytes,
              "predicted": planner_figures(spec=spec, stage=stage,
                                           dp_rank=parallel_state.get_data_parallel_rank())}
    hybrid.engine.destroy()
    del hybrid, chunks
    gc.collect()
    return result


def activations_case(case: dict, *, model_dir: str, world: int) -> dict:
    """One forward + loss of this rank's megatron-core chunk, measured, with the planner's prediction."""
    import torch

    from live_tensors import measure_forward
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout
    from toolkit.plan.memory import stage_activation_bytes, stage_memory, stage_params_per_gpu
    from toolkit.spec.load import validate_spec

    tp, dp = case["tp"], world // case["tp"]
    spec = validate_spec(job_spec(model_dir=model_dir, tp=tp, pp=1, dp=dp, zero=1, precision=case["precision"],
                                  persistence=0, micro=case["micro"], seq=case["seq"], recompute=case["recompute"]),
                         source="live_memory")
    _use_layout(tp=tp, pp=1, dp=dp)
    dtype = torch.bfloat16 if case["precision"] == "bf16" else torch.float32
    chunks, info = load_model_chunks(checkpoint=Path(model_dir), layout=Layout(tp=tp, dp=dp), params_dtype=dtype,
                                     recompute=case["recompute"])
    [batch] = random_batches(count=1, micro=case["micro"], seq=case["seq"], vocab=info.settings.vocab_size, seed=3)
    measured = measure_forward(chunks[0], batch=batch, vocab_size=info.settings.vocab_size)
    from toolkit.check.checks import planner_inputs
    from toolkit.spec.load import model_shape

    layout, training, _, assumptions = planner_inputs(spec)
    shape = model_shape(spec.model)
    figures = {"shape": shape, "layout": layout, "training": training, "assumptions": assumptions}
    predicted = {"layers": stage_activation_bytes(**figures), "peak": stage_memory(**figures, stage=0).activations}
    return {"case": case, "measured": measured, "predicted": predicted,
            "live_params": sum(p.numel() for p in chunks[0].parameters()),
            "predicted_params": stage_params_per_gpu(shape=shape, layout=layout, stage=0)}


def _states(layouts, *, zeros_pp1=(0, 1, 2, 3), precisions=("fp32", "bf16")) -> list[dict]:
    """Every (layout, ZeRO stage, precision); ZeRO-2/3 only at pp = 1 (dsmt refuses them with pp > 1)."""
    return [{"tp": tp, "pp": pp, "dp": dp, "zero": zero, "precision": precision, "persistence": 0}
            for tp, pp, dp in layouts for zero in (zeros_pp1 if pp == 1 else (0, 1)) for precision in precisions]


# Two launches: every layout of a launch has tp x pp x dp = its processes. Four layouts get every ZeRO stage and
# precision; dp = 4 adds fp32 ZeRO-2 (whole gradients at partition boundaries) and ZeRO-3 with the default
# persistence threshold (every tiny parameter stays whole). Activations: tp 1 and 2, recompute none / selective /
# full, micro-batch sizes 1 / 2 / 4, bf16 and fp32, local attention (the CPU's).
ACTIVATION_CASES = [{"tp": tp, "precision": precision, "recompute": recompute, "micro": micro, "seq": seq}
                    for tp in (1, 2) for precision, recompute, micro, seq in
                    [("bf16", "none", 1, 64), ("bf16", "none", 2, 64), ("bf16", "none", 4, 32),
                     ("bf16", "selective", 2, 64), ("bf16", "full", 2, 64), ("fp32", "none", 2, 64)]]
LAUNCHES = (
    (2, {"states": _states([(1, 1, 2), (2, 1, 1), (1, 2, 1)]), "activations": ACTIVATION_CASES}),
    (4, {"states": _states([(2, 2, 1)]) + [
        {"tp": 1, "pp": 1, "dp": 4, "zero": 2, "precision": "fp32", "persistence": 0},
        {"tp": 1, "pp": 1, "dp": 4, "zero": 3, "precision": "bf16", "persistence": 100_000}]}),
)

# The benchmark's smoke mode: one 2-process launch, bf16 ZeRO-1 and ZeRO-3 at dp 2, and one activation case per
# recompute kind (the full set above is tests/plan/test_live_engine.py's).
SMOKE_LAUNCHES = ((2, {"states": _states([(1, 1, 2)], zeros_pp1=(1, 3), precisions=("bf16",)),
                       "activations": [c for c in ACTIVATION_CASES
                                       if c["tp"] == 1 and c["precision"] == "bf16" and c["micro"] == 2]}),)


def run_launch(*, model_dir: Path, out_dir: Path, processes: int, cases: dict, timeout_s: float = 600) -> list[dict]:
    """Run one launch of this file under torchrun (or the test session's warm ranks: tests/harness/warm_ranks.py);
    the per-rank results."""
    import os
    import tempfile

    from toolkit.launch.local import run_ranks
    from toolkit.launch.ports import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [str(model_dir), str(out_dir), json.dumps(cases)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={processes}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", __file__, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryFile("w+") as output:
        returncode = run_ranks(command, target=["path", __file__], args=args, nprocs=processes, env=env,
                               stdout=output, stderr=output, timeout_s=timeout_s)
        output.seek(0)
        text = output.read()
    if returncode != 0:
        errors = [line for line in text.splitlines() if "Error" in line]
        raise RuntimeError("live_memory launch failed:\n" + "\n".join(errors[:10]) + "\n" + text[-3000:])
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]


def deviation(live: float, predicted: float) -> float:
    """(live - predicted) / predicted; 0 when both are 0."""
    return 0.0 if live == predicted else (live - predicted) / predicted if predicted else float("inf")


def state_rows(ranks: list[dict]) -> list[dict]:
    """One row per case and rank: live and predicted bytes per category, and their deviation."""
    rows = []
    for rank, result in enumerate(ranks):
        for item in result["states"]:
            case, live, predicted = item["case"], item["live"], item["predicted"]
            row = {"layout": f"tp{case['tp']} pp{case['pp']} dp{case['dp']}", "zero": case["zero"],
                   "precision": case["precision"], "persistence": case["persistence"], "rank": rank,
                   "stage": item["stage"], "optimizer_class": item["optimizer_class"],
                   "unclassified": live["unclassified"],
                   "params_live": item["live_params"], "params_predicted": item["predicted"]["params"],
                   "build": (item["build_peak"], predicted["build_peak"])}
            for category in ("parameters", "gradients", "optimizer", "buffers"):
                row[category] = (live[category], predicted[category], deviation(live[category], predicted[category]))
            rows.append(row)
    return rows


def activation_rows(ranks: list[dict]) -> list[dict]:
    """One row per case and rank: stored layer bytes and the forward + loss peak, measured and predicted."""
    rows = []
    for rank, result in enumerate(ranks):
        for item in result["activations"]:
            measured, predicted = item["measured"], item["predicted"]
            rows.append({**item["case"], "rank": rank, "params_live": item["live_params"],
                         "params_predicted": item["predicted_params"],
                         "layers": (measured["saved"]["layers"], predicted["layers"],
                                    deviation(measured["saved"]["layers"], predicted["layers"])),
                         "peak": (measured["peak"], predicted["peak"], deviation(measured["peak"], predicted["peak"])),
                         "forward_peak": measured["forward_peak"]})
    return rows


def format_state_table(rows: list[dict]) -> str:
    """Predicted vs live bytes per category and rank (KiB), with the deviation."""
    lines = [f"{'layout':<12} {'zero':>4} {'prec':<5} {'rank':>4} {'stage':>5} "
             + " ".join(f"{name + ' live/pred KiB (dev)':>34}" for name in ("parameters", "gradients", "optimizer"))
             + f" {'buffers live/pred KiB':>22}"]
    for row in rows:
        cells = " ".join(f"{row[c][0] / 1024:>10.1f} /{row[c][1] / 1024:>10.1f} ({row[c][2]:+7.2%})"
                         for c in ("parameters", "gradients", "optimizer"))
        layout = row["layout"] + ("*" if row["persistence"] else "")
        lines.append(f"{layout:<12} {row['zero']:>4} {row['precision']:<5} {row['rank']:>4} {row['stage']:>5} {cells} "
                     f"{row['buffers'][0] / 1024:>10.1f} /{row['buffers'][1] / 1024:>10.1f}")
    return "\n".join(lines)


def format_activation_table(rows: list[dict]) -> str:
    """Stored layer activations and the forward + loss peak per case and rank (KiB), with the deviation."""
    lines = [f"{'tp':>2} {'prec':<5} {'recompute':<9} {'mbs':>3} {'seq':>3} {'rank':>4} "
             f"{'layers saved/pred KiB (dev)':>34} {'peak live/pred KiB (dev)':>34}"]
    for row in rows:
        cells = " ".join(f"{row[c][0] / 1024:>10.1f} /{row[c][1] / 1024:>10.1f} ({row[c][2]:+7.2%})"
                         for c in ("layers", "peak"))
        lines.append(f"{row['tp']:>2} {row['precision']:<5} {row['recompute']:<9} {row['micro']:>3} {row['seq']:>3} "
                     f"{row['rank']:>4} {cells}")
    return "\n".join(lines)


def main(model_dir: str, out_dir: str, cases_json: str) -> None:
    from toolkit import backend as backends

    backends.current()  # before DeepSpeed is imported: it restores torch factories to its import-time originals
    import torch.distributed as dist

    cases = json.loads(cases_json)
    results = {"states": [], "activations": [], "seconds": {}}
    for kind, run in (("states", states_case), ("activations", activations_case)):
        start = time.perf_counter()
        for case in cases.get(kind, []):
            extra = {"world": int(__import__("os").environ["WORLD_SIZE"])} if kind == "activations" else {}
            results[kind].append(run(case, model_dir=model_dir, **extra))
            dist.barrier()
        results["seconds"][kind] = time.perf_counter() - start
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(*sys.argv[1:4])
