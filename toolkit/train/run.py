"""One rank of a `dsmt train` run: job spec in, trained HF checkpoint out.

Every rank runs this (under torchrun, the deepspeed launcher, SLURM or `dsmt train`'s local launcher)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from toolkit.errors import DsmtError
from toolkit.train import checkpoints
from toolkit.train.report import RunLog


def model_checkpoint(*, spec, output_dir: Path) -> Path:
    """The HF checkpoint to start from: `model.path`, or a random init of the inline `model.config` (rank 0
    writes it once into the output dir; a tiny model for CPU runs and the demo)."""
    import torch.distributed as dist

    require_weights(spec)
    if spec.model.path is not None:
        return Path(spec.model.path)
    init_dir = output_dir / "init-hf"
    if dist.get_rank() == 0 and not (init_dir / "config.json").is_file():
        from toolkit.tiny import save_random_init

        save_random_init(init_dir, config_fields=spec.model.config, seed=spec.training.seed)
    dist.barrier()
    return init_dir


def require_weights(spec) -> None:
    """What `dsmt train` needs beyond `dsmt check` (which also serves `dsmt generate` for other trainers)."""
    if spec.parallel.sequence_parallel:
        raise DsmtError("parallel.sequence_parallel=true is not wired into `dsmt train` yet (it was not tested on "
                        "GPU); set parallel.sequence_parallel=false, or use training.recompute to save activations")
    if spec.model.path is None and spec.model.config is None:
        raise DsmtError(f"model.builtin={spec.model.builtin!r} is a shape without weights: `dsmt train` needs "
                        "model.path (an HF checkpoint) or model.config (an HF config to initialise randomly)")


def params_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def build_batches(*, spec, layout, hf_dir: Path, vocab_size: int):
    from megatron.core import parallel_state

    from toolkit.data import MicroBatches, build_examples

    examples = build_examples(data=spec.data, model_path=str(hf_dir), seq_length=layout.seq_length,
                              vocab_size=vocab_size, seed=spec.training.seed)
    return MicroBatches(examples=examples, micro_batch_size=layout.micro_batch_size,
                        num_microbatches=layout.grad_accum_steps, dp_rank=parallel_state.get_data_parallel_rank(),
                        dp_size=layout.dp, seed=spec.training.seed, shuffle=spec.data.shuffle)


def train(*, spec) -> list[dict]:
    """Run the spec's training on this rank; returns the per-step history (same on every rank)."""
    from toolkit import backend as backends
    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.parallel import Layout, init_process_groups
    from toolkit.spec.layout import derive_layout
    from toolkit.train import plain

    backend = backends.current()
    layout = derive_layout(spec)
    parallel = Layout(tp_size=layout.tp, pp_size=layout.pp, vpp_size=layout.vpp, dp_size=layout.dp)
    init_process_groups(layout=parallel, dist_backend=backend.dist_backend)
    backend.seed(spec.training.seed)
    output_dir = Path(spec.training.output_dir)
    hf_dir = model_checkpoint(spec=spec, output_dir=output_dir)
    ds_config = build_deepspeed_config(spec=spec, layout=layout)
    build = _plain_parts if plain.is_plain_model(hf_dir) else _hybrid_parts
    trainer, batches, export, notice = build(spec=spec, layout=layout, parallel=parallel, hf_dir=hf_dir,
                                             ds_config=ds_config, output_dir=output_dir)
    return _run(trainer=trainer, batches=batches, export=export, notice=notice, spec=spec, layout=layout,
                ds_config=ds_config, output_dir=output_dir)


def _hybrid_parts(*, spec, layout, parallel, hf_dir: Path, ds_config: dict, output_dir: Path):
    """megatron-core chunks from the adapters inside DeepSpeed, on tokenised `datasets` data."""
    import torch.distributed as dist

    from toolkit.models import load_model_chunks
    from toolkit.train.engine import HybridEngine

    chunks, info = load_model_chunks(checkpoint=hf_dir, layout=parallel, params_dtype=params_dtype(spec.training.precision),
                                     show_progress=dist.get_rank() == 0, recompute=spec.training.recompute)
    hybrid = HybridEngine(chunks=chunks, ds_config=ds_config, vocab_size=info.settings.vocab_size,
                          tied_embeddings=info.settings.tied_embeddings, pp_size=layout.pp)
    batches = build_batches(spec=spec, layout=layout, hf_dir=hf_dir, vocab_size=info.settings.vocab_size)
    return hybrid, batches, lambda: _export(hybrid=hybrid, info=info, spec=spec, output_dir=output_dir), None


def _plain_parts(*, spec, layout, parallel, hf_dir: Path, ds_config: dict, output_dir: Path):
    """An HF model without a megatron-core adapter: DeepSpeed ZeRO data parallelism only, synthetic inputs."""
    from megatron.core import parallel_state

    from toolkit.train import plain

    model_type = json.loads((hf_dir / "config.json").read_text())["model_type"]
    plain.check_plain_layout(tp=layout.tp, pp=layout.pp, model_type=model_type)
    if spec.data.path is not None:
        raise DsmtError(f"data.path is set, but model_type {model_type} has no adapter and trains on synthetic inputs "
                        "only; leave data.path unset")
    model = plain.load_plain_model(hf_dir, dtype=params_dtype(spec.training.precision))
    engine = plain.PlainEngine(model=model, ds_config=ds_config)
    batches = plain.PlainBatches(model_config=model.config, micro_batch_size=layout.micro_batch_size,
                                 num_microbatches=layout.grad_accum_steps, dp_rank=parallel_state.get_data_parallel_rank(),
                                 dp_size=layout.dp, seed=spec.training.seed, seq_length=layout.seq_length)
    notice = plain.plain_notice(model_type=model_type, zero_stage=spec.parallel.zero_stage)
    return engine, batches, lambda: plain.export_plain(engine=engine.engine, out_dir=output_dir / "final-hf"), notice


def _run(*, trainer, batches, export, notice: str | None, spec, layout, ds_config: dict, output_dir: Path) -> list[dict]:
    """Resume, train to train_steps with checkpoints, export, report: the same for every kind of trainer."""
    import torch.distributed as dist

    log = RunLog(output_dir=output_dir, is_writer=dist.get_rank() == 0, layout=layout, spec=spec, ds_config=ds_config)
    if notice and dist.get_rank() == 0:
        print(notice, flush=True)
    start = checkpoints.resume(engine=trainer.engine, checkpoint_dir=output_dir / "checkpoints")
    log.started(start_step=start, total_steps=spec.training.train_steps)
    _loop(trainer=trainer, batches=batches, spec=spec, log=log, start=start, output_dir=output_dir)
    export()
    log.finished()
    return log.history


def _loop(*, trainer, batches, spec, log, start: int, output_dir: Path) -> None:
    import torch.distributed as dist

    total = spec.training.train_steps
    with tqdm(total=total, initial=start, desc="training", disable=dist.get_rank() != 0, leave=False) as bar:
        for step in range(start, total):
            stats = trainer.train_step(batches.batches_for_step(step))
            log.step(step=step + 1, stats=stats, engine=trainer.engine)
            bar.update(1)
            if (step + 1) % spec.training.checkpoint_interval == 0 or step + 1 == total:
                checkpoints.save(engine=trainer.engine, checkpoint_dir=output_dir / "checkpoints", step=step + 1)


def _export(*, hybrid, info, spec, output_dir: Path) -> None:
    """Trained weights -> dsmt megatron checkpoint (collective) -> HF directory (rank 0, one process)."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    from toolkit.models import save_mcore_checkpoint
    from toolkit.train.engine import zero3_gathered

    mcore_dir, hf_dir = output_dir / "final-mcore", output_dir / "final-hf"
    with zero3_gathered(hybrid.engine):
        save_mcore_checkpoint(chunks=hybrid.chunks, info=info, out_dir=mcore_dir,
                              params_dtype=params_dtype(spec.training.precision), overwrite=True)
    if dist.get_rank() == 0:
        # A fresh one-process job: the launcher's RANK / WORLD_SIZE / MASTER_* must not leak into it.
        launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in launcher_vars and not k.startswith("TORCHELASTIC")}
        subprocess.run([sys.executable, "-m", "toolkit.cli", "convert", "mcore-to-hf", str(mcore_dir), str(hf_dir),
                        "--overwrite"], check=True, env=env)
    dist.barrier()


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m toolkit.train")
    parser.add_argument("--config", required=True, help="job spec (YAML/JSON)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    from toolkit.spec.checks import check_file

    spec, report = check_file(args.config, overrides=args.set)
    if spec is None or not report.ok:
        raise DsmtError(f"job spec {args.config} does not pass `dsmt check`:\n{report.to_text()}")
    train(spec=spec)  # a run resumed after its last step has nothing to do, and succeeds
    return 0

