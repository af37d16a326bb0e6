"""`dsmt demo`: dsmt end to end on a tiny Llama it builds (no download; 2 CPU cores are enough), into ./dsmt-demo/.

build an HF checkpoint -> convert to a layout-free megatron checkpoint -> verify logits at TP2 x PP2 from both
the HF and the megatron checkpoint -> export back to HF and check the round trip is bit-exact -> the planner's
memory and pipeline pictures of the training layout -> `dsmt generate` of the job -> fine-tune with `dsmt train` at
PP2 x DP2 ZeRO-1 (4 processes) on two sentences it writes (toolkit/demo/learning.py) -> greedy samples with
transformers from the random start and from the fine-tuned export, side by side -> summary.txt naming every file.
A re-run replaces the demo's own files in the directory and keeps anything else there (toolkit/demo/files.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from toolkit.demo import learning
from toolkit.demo.files import DemoFiles, replace_workdir, this_dsmt

DEFAULT_WORKDIR = Path("dsmt-demo")
TRAIN_STEPS = 30  # both sentences are written from about step 25 on (toolkit/demo/learning.py)
TRAIN_RANKS = 4  # pipeline 2 x data-parallel 2 (demo_spec)


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="convert, verify, plan, fine-tune and export a tiny Llama on this "
                                   "machine, into ./dsmt-demo/")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                        help="where the demo's files go (default ./dsmt-demo; an earlier demo's files there are "
                        "replaced, anything else there is kept)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size of the logit check")
    parser.add_argument("--pp", type=int, default=2, help="pipeline parallel size of the logit check")
    parser.add_argument("--train-steps", type=int, default=TRAIN_STEPS,
                        help=f"fine-tune steps (default {TRAIN_STEPS}; the tiny model writes the two sentences it "
                        "is taught from about step 25)")
    parser.add_argument("--verbose", action="store_true", help="every rank's output and the libraries' warnings "
                        "on the console (default: rank 0 speaks)")
    parser.set_defaults(func=run)


def run(args) -> int:
    # The demo is a CPU run (gloo, 4 ranks, tiny model). On a GPU machine its CPU spec would be refused
    # (cluster.device=cpu with CUDA visible), so hide the GPUs from this process and its ranks; CUDA reads the
    # variable when it is first used, which nothing has done yet.
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        print("dsmt demo runs on the CPU: CUDA_VISIBLE_DEVICES='' for this run", flush=True)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed is told, instead of warning that it found no GPU
    workdir, dsmt = args.workdir.expanduser().absolute(), this_dsmt()
    passed = replace_workdir(workdir=workdir, build=lambda: run_demo(workdir=workdir, tp=args.tp, pp=args.pp,
                                                                     train_steps=args.train_steps, dsmt=dsmt))
    return 0 if passed else 1


def _step(message: str) -> float:
    print(f"\n== {message}", flush=True)
    return time.perf_counter()


def demo_spec(*, model_dir: Path, data_path: Path, output_dir: Path, train_steps: int) -> dict:
    """The demo's job spec: 4 CPU ranks, pipeline 2 x data-parallel 2, ZeRO-1, fp32. lr 1e-2 after 7 warm-up steps
    (a quarter of a short run) teaches the two sentences in about 25 steps (in a single-process reproduction, 3e-3
    after 2 warm-up steps needed about 60, and 2e-2 was unsteady: toolkit/demo/learning.py)."""
    return {
        "model": {"path": str(model_dir)},
        "cluster": {"nodes": 1, "gpus_per_node": TRAIN_RANKS, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
        "parallel": {"tp": 1, "pp": 2, "zero_stage": 1},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 64, "precision": "fp32",
                     "lr": 1e-2, "min_lr": 1e-3, "lr_schedule": "cosine", "weight_decay": 0.0,
                     "warmup_steps": train_steps // 4,
                     "train_steps": train_steps, "checkpoint_interval": train_steps, "log_interval": 10,
                     "output_dir": str(output_dir)},
        "data": {"path": str(data_path)},
    }


def run_demo(*, workdir: Path, tp: int, pp: int, train_steps: int = TRAIN_STEPS, dsmt: str = "dsmt") -> bool:
    """Every step into `workdir`; prints what each step found and, at the end, the files and what to run next
    (`dsmt`: the command that runs dsmt from the user's shell); True when all passed."""
    files = DemoFiles(workdir=workdir)
    start = _step(f"building a tiny random Llama (GQA 8/2 heads, vocab 250) in {files.hf}")
    from toolkit.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(files.hf)
    files.add(files.hf, "the HF checkpoint it built (config.json, model.safetensors, tokenizer)")
    before = learning.samples(files.hf)  # the random start, for the comparison after the fine-tune
    verified = _convert_and_verify(files=files, tp=tp, pp=pp)
    exact = _export(files=files)
    spec = _write_spec(files=files, train_steps=train_steps)
    _plan_and_generate(files=files, spec_path=files.spec)
    history = _fine_tune(files=files, spec_path=files.spec, train_steps=train_steps)
    after = _compare_samples(files=files, before=before)
    first, last = history[0]["loss"], history[-1]["loss"]
    wrote = learning.writes_sentences(after)
    learned = wrote and last < first / 2  # the sentences written, and a clear fall of the loss
    print(f"  loss {first:.3f} -> {last:.3f} over {len(history)} steps; the fine-tuned model "
          f"{'writes' if wrote else 'does NOT write'} the sentences it was trained on")
    passed = exact and learned and verified
    files.add(files.workdir / "summary.txt", "this list")
    summary = files.summary(passed=passed, seconds=time.perf_counter() - start, samples=(before, after),
                            spec=spec, losses=(first, last), dsmt=dsmt)
    (files.workdir / "summary.txt").write_text(summary)
    print("\n" + summary, end="")
    return passed


def _convert_and_verify(*, files: DemoFiles, tp: int, pp: int) -> bool:
    from toolkit.convert.hf_to_mcore import convert_hf_to_mcore
    from toolkit.verify.run import run_verify_many

    _step("dsmt convert hf-to-mcore")
    print(convert_hf_to_mcore(hf_dir=files.hf, out_dir=files.mcore, overwrite=True, show_progress=False).line())
    files.add(files.mcore, "`dsmt convert hf-to-mcore`: megatron-core dist_checkpointing, loads at any TP/PP")
    _step(f"dsmt verify at tp={tp} pp={pp} ({tp * pp} processes), HF checkpoint and megatron checkpoint")
    results = run_verify_many(checkpoints=[files.hf, files.mcore], tp=tp, pp=pp)
    for result in results:
        print(f"  {result['checkpoint_kind']:5s} max|Δlogits|={result['max_abs_diff']:.2e} "
              f"KL={result['kl_divergence']:.2e} {'PASS' if result['passed'] else 'FAIL'}")
    verify_file = files.workdir / "verify.json"
    verify_file.write_text(json.dumps(results, indent=2) + "\n")
    worst = max(r["max_abs_diff"] for r in results)
    files.add(verify_file, f"`dsmt verify --tp {tp} --pp {pp}` of both: max|Δlogits| {worst:.1e} vs HF")
    return all(r["passed"] for r in results)


def _export(*, files: DemoFiles) -> bool:
    from toolkit.convert.mcore_to_hf import convert_mcore_to_hf

    _step("dsmt convert mcore-to-hf")
    print(convert_mcore_to_hf(mcore_dir=files.mcore, out_dir=files.export, overwrite=True).line())
    exact = _round_trip_exact(files.hf, files.export)
    print(f"  round trip bit-exact: {exact}")
    files.add(files.export, f"`dsmt convert mcore-to-hf`: bit-exact with {files.hf.name}: {exact}")
    return exact


def _write_spec(*, files: DemoFiles, train_steps: int) -> dict:
    import yaml

    learning.write_data(files.data)
    files.add(files.data, f"the fine-tune's {learning.RECORDS} records: {' / '.join(learning.SENTENCES)}")
    spec = demo_spec(model_dir=files.hf, data_path=files.data, output_dir=files.train, train_steps=train_steps)
    files.spec.write_text(yaml.safe_dump(spec, sort_keys=False))
    files.add(files.spec, "the job spec it trains (`dsmt check`, `dsmt generate`, `dsmt train` take it)")
    return spec


def _plan_and_generate(*, files: DemoFiles, spec_path: Path) -> None:
    from toolkit.demo.plan import console_lines, plan_pictures
    from toolkit.check.job import check_job_file
    from toolkit.errors import SpecError
    from toolkit.generate.writer import write_run_dir

    try:
        job = check_job_file(spec_path)
    except SpecError as err:
        raise RuntimeError(f"the demo's own spec does not pass `dsmt check`:\n{err.report.to_text()}") from err
    spec = job.spec
    _step("dsmt plan: memory and pipeline pictures of the training layout on a GPU cluster; dsmt generate: its run "
          "directory")
    for path, what in plan_pictures(spec=spec, model_dir=files.hf, out_dir=files.workdir / "plan"):
        files.add(path, what)
    print("\n".join(console_lines((files.workdir / "plan" / "plan.txt").read_text())))
    write_run_dir(job=job, out_dir=files.run, overwrite=True)
    files.add(files.run, "`dsmt generate`: ds_config.json, megatron.json, launch_deepspeed.sh, launch_torchrun.sh, "
                         "job.sbatch, summary.txt")
    print(f"  {files.workdir / 'plan'}, {files.run}")


def _fine_tune(*, files: DemoFiles, spec_path: Path, train_steps: int) -> list[dict]:
    from toolkit.check.prelaunch import checked_file_before_launch
    from toolkit.train.job.launch import launch_training

    _step(f"dsmt train {spec_path.name}  (pp=2 dp=2 ZeRO-1, 4 processes, {train_steps} steps)")
    job = checked_file_before_launch(path=str(spec_path), overrides=(), run_dir=None)
    launch_training(job=job, spec_file=spec_path, source=str(spec_path))
    metrics = [json.loads(line) for line in (files.train / "metrics.jsonl").read_text().splitlines()]
    files.add(files.trained, "the fine-tuned model, HF format: AutoModelForCausalLM.from_pretrained(this)")
    files.add(files.train / "final-mcore", "the same weights as a megatron-core checkpoint")
    files.add(files.train / "loss_curve.png", "training loss per step")
    files.add(files.train / "metrics.jsonl", "one JSON line per step: loss, lr, grad norm, tokens/s, memory")
    files.add(files.train / "logs", "ranks 1-3's output (rank 0 spoke above)")
    return [m for m in metrics if "loss" in m]


def _compare_samples(*, files: DemoFiles, before: list[str]) -> list[str]:
    """Greedy samples of the fine-tuned export, printed beside those of the random start."""
    where = files.trained.relative_to(files.workdir)
    _step(f"transformers' generate, greedy: {files.hf.name}/ (random start) against {where}/ (fine-tuned)")
    after = learning.samples(files.trained)
    print("\n".join(learning.comparison_lines(before=before, after=after)))
    return after


def _round_trip_exact(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(left) == sorted(right) and all(torch.equal(left[k], right[k]) for k in left)
