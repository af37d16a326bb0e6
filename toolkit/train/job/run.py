"""One rank of a `dsmt train` run: checked job in (toolkit/check/job.py), trained HF checkpoint out.

Every rank runs this (under torchrun, the deepspeed launcher, SLURM or `dsmt train`'s local launcher)."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.spec.lr_schedule import LrSchedule
from toolkit.train.job.hf_export import export_trained, params_dtype  # run.export_trained, run.params_dtype: as before


def model_checkpoint(*, spec, output_dir: Path) -> Path:
    """The HF checkpoint to start from: `model.path`; for the inline `model.config` a random HF init (rank 0
    writes it once into the output dir; a tiny model for CPU runs and the demo); for `model.builtin` only the
    shape's config.json and the tokenizer files (`toolkit/train/job/pretrain.py`: megatron-core initialises the weights)."""
    import torch.distributed as dist

    require_weights(spec)
    if spec.model.path is not None:
        return Path(spec.model.path)
    init_dir = output_dir / "init-hf"
    if dist.get_rank() == 0 and not (init_dir / "config.json").is_file():
        from toolkit.models.tiny import save_random_init
        from toolkit.train.job.pretrain import write_init_dir

        if spec.model.builtin is not None:
            write_init_dir(init_dir, spec=spec)
        else:
            save_random_init(init_dir, config_fields=spec.model.config, seed=spec.training.seed)
    dist.barrier()
    return init_dir


def require_weights(spec) -> None:
    """What `dsmt train` needs beyond `dsmt check` (which also serves `dsmt generate` for other trainers)."""
    if spec.model.builtin is not None:  # pretrained from megatron-core's init: a Llama-like shape, a fitting tokenizer
        from toolkit.train.job.pretrain import require_trainable

        require_trainable(spec)


def build_batches(*, spec, layout, hf_dir: Path, vocab_size: int):
    from megatron.core import parallel_state

    from toolkit.data import MicroBatches, job_rows

    # Collective: records are tokenised once (rank 0) into the on-disk cache and memory-mapped on every rank;
    # Megatron corpora are read through megatron-core's datasets (toolkit/data/training.py).
    examples = job_rows(data=spec.data, model_path=str(hf_dir), seq_length=layout.seq_length, vocab_size=vocab_size,
                        seed=spec.training.seed, output_dir=spec.training.output_dir,
                        num_samples=spec.training.train_steps * layout.global_batch_size)
    # megatron-core's GPTDataset has shuffled its samples with the seed already
    if getattr(examples, "kind", None) == "preference":  # micro-batches of pairs (toolkit/data/preference.py)
        from toolkit.data import PreferenceBatches as MicroBatches
    return MicroBatches(examples=examples, micro_batch_size=layout.micro_batch_size,
                        num_microbatches=layout.grad_accum_steps, dp_rank=parallel_state.get_data_parallel_rank(),
                        dp_size=layout.dp, seed=spec.training.seed, shuffle=spec.data.shuffle and not spec.data.is_megatron)


def train(*, job) -> list[dict]:
    """Run the checked job's training on this rank; returns the per-step history (same on every rank). The job
    carries the DeepSpeed config (a run directory's, already compared with the spec: toolkit/train/job/run_files.py)
    and how to resume (`job.resume_fallback`: from the newest intact checkpoint when the newest is damaged)."""
    from toolkit.train.plain import engine as plain

    spec = job.spec
    layout = start_process_groups(job=job)
    _node_joined(layout=layout)
    output_dir = Path(spec.training.output_dir)
    hf_dir = model_checkpoint(spec=spec, output_dir=output_dir)
    ds_config = job.ds_config()
    build = _plain_parts if plain.is_plain_model(hf_dir) else _hybrid_parts
    parts = build(spec=spec, layout=layout, hf_dir=hf_dir, ds_config=ds_config, output_dir=output_dir)
    from toolkit.train.job.loop import run_to_end

    return run_to_end(parts=parts, job=job, layout=layout, hf_dir=hf_dir)


def start_process_groups(*, job):
    """This rank's start, as `dsmt train` and `toolkit.api.initialize` make it: the spec's backend (its device or an
    error, never a silent CPU run), the checked layout's process groups, the seeded RNGs; returns the layout.
    Collective."""
    from toolkit import backend as backends
    from toolkit.parallel.groups import init_process_groups

    spec, layout = job.spec, job.layout
    backend = backends.select(device=spec.cluster.device)
    init_process_groups(layout=layout, dist_backend=backend.dist_backend,
                        timeout_s=collective_timeout_s(spec=spec, dist_backend=backend.dist_backend, model=job.model))
    backend.seed(spec.training.seed)
    name_wandb_run(spec=spec)
    return layout


def collective_timeout_s(*, spec, dist_backend: str, model=None) -> float:
    """training.collective_timeout_s, else the larger of 600 s under NCCL (its usual watchdog timeout; 180 s on the
    CPU backend, where a stalled rank should not keep a test or a demo silent for ten minutes) and the planner's
    bound on a save's wait for its slowest writer (toolkit/plan/checkpoint_cost.py `save_wait_s`; `model`: the
    job's ModelShape, its every parameter counted: an upper bound under LoRA, which only lengthens the wait)."""
    if spec.training.collective_timeout_s is not None:
        return float(spec.training.collective_timeout_s)
    floor = 600.0 if dist_backend == "nccl" else 180.0
    if model is None:
        return floor
    from toolkit.plan.checkpoint_cost import save_wait_s

    ranks = spec.cluster.nodes * spec.cluster.gpus_per_node
    return max(floor, save_wait_s(trainable_params=model.num_params(), ranks=ranks,
                                  ranks_per_node=min(ranks, spec.cluster.gpus_per_node)))


def name_wandb_run(*, spec) -> None:
    """DeepSpeed's wandb monitor calls `wandb.init(project, group, entity)` on global rank 0 with no run name, and
    wandb.init then reads WANDB_NAME. Set here, in the rank itself before `deepspeed.initialize`, the name reaches
    rank 0 under every launcher (`dsmt train`, torchrun, the deepspeed launcher over pdsh / mpirun, srun, a user's
    script through `toolkit.api.initialize`) with nothing to forward. The spec's name wins over an exported one;
    without `training.wandb.name` an exported WANDB_NAME (or W&B's random name) is used. WANDB_MODE and the other
    WANDB_* variables are never touched: `WANDB_MODE=offline` reaches wandb as the user set it."""
    wandb = spec.training.wandb
    if wandb is not None and wandb.name is not None:
        os.environ["WANDB_NAME"] = wandb.name


def _node_joined(*, layout) -> None:
    """One line per node (its first local rank): which ranks run there, so a multi-node log shows every node
    joined. Launchers give consecutive ranks to a node's processes (torchrun, deepspeed, srun, mpirun by slot)."""
    import socket

    import torch.distributed as dist

    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    from toolkit.launch.rank_output import say_on_console

    per_node, rank = layout.gpus_per_node, dist.get_rank()
    say_on_console(f"dsmt train: node {rank // per_node} of {layout.nodes}: ranks {rank}..{rank + per_node - 1} on "
                   f"{socket.gethostname()}")  # every node's first rank, its output in a file or not


def _hybrid_parts(*, spec, layout, hf_dir: Path, ds_config: dict, output_dir: Path):
    """megatron-core chunks from the adapters inside DeepSpeed, on tokenised `datasets` data (a `loop.TrainParts`)."""
    import functools

    from toolkit.train.job.hf_export import export_hybrid_into
    from toolkit.train.job.loop import TrainParts
    from toolkit.train.job.preference_run import precomputed_reference

    hybrid, info = build_hybrid(spec=spec, layout=layout, hf_dir=hf_dir, ds_config=ds_config)
    if info.settings.encoder is not None:  # BERT-style: HF keyword batches of the head's task
        batches = encoder_batches(spec=spec, layout=layout, hf_dir=hf_dir, hf_config=info.hf_config)
    else:
        batches = build_batches(spec=spec, layout=layout, hf_dir=hf_dir, vocab_size=info.settings.vocab_size)
        reference = precomputed_reference(spec=spec, layout=layout, hybrid=hybrid, examples=batches.examples,
                                          hf_dir=hf_dir, batches=batches)
        batches = reference if reference is not None else batches  # with each pair's precomputed reference
    return TrainParts(trainer=hybrid, batches=batches,
                      export=lambda: _export(hybrid=hybrid, info=info, spec=spec, output_dir=output_dir),
                      export_into=functools.partial(export_hybrid_into, hybrid=hybrid, info=info,
                                                    precision=spec.training.precision, lora=spec.training.lora))


def build_hybrid(*, spec, layout, hf_dir: Path, ds_config: dict):
    """(HybridEngine, checkpoint info): this rank's megatron-core chunks of `hf_dir` (or megatron-core's own init
    for `model.builtin`), LoRA when the spec asks, inside DeepSpeed. Process groups must exist."""
    import torch.distributed as dist

    from toolkit.convert.chunks import load_model_chunks
    from toolkit.spec.layout import spec_attention
    from toolkit.train.engine.hybrid import HybridEngine
    from toolkit.train.engine.tasks import task_for_model
    from toolkit.train.job.preference_run import dpo_task_and_reference

    # At ZeRO-3 the chunks are built partitioned (and loaded one parameter at a time): toolkit/adapters/zero3.py.
    zero3_config = ds_config if spec.parallel.zero_stage == 3 else None
    dtype = params_dtype(spec.training.precision)
    if spec.model.builtin is not None:  # megatron-core's own initialisation, no weights read
        from toolkit.train.job.pretrain import init_chunks

        chunks, info = init_chunks(spec=spec, hf_dir=hf_dir, layout=layout, params_dtype=dtype,
                                   zero3_config=zero3_config)
    else:
        chunks, info = load_model_chunks(checkpoint=hf_dir, layout=layout, params_dtype=dtype,
                                         show_progress=dist.get_rank() == 0, recompute=spec.training.recompute,
                                         attention=spec_attention(spec), zero3_config=zero3_config,
                                         fusions=spec.training.fusions)
    if dist.get_rank() == 0:
        _say_passthrough(info)
    if spec.training.lora is not None:  # freeze the base, attach the adapters (toolkit/train/lora/adapters.py)
        from toolkit.train.lora.apply import apply_lora

        apply_lora(chunks, settings=info.settings, lora=spec.training.lora, seed=spec.training.seed)
    dpo_task, reference = dpo_task_and_reference(spec=spec, layout=layout, info=info, params_dtype=dtype,
                                                 attention=spec_attention(spec))
    hybrid = HybridEngine(chunks=chunks, ds_config=ds_config, vocab_size=info.settings.vocab_size,
                          tied_embeddings=info.settings.tied_embeddings, pp_size=layout.pp,
                          task=dpo_task or task_for_model(settings=info.settings), reference=reference,
                          lr_schedule=LrSchedule.from_training(spec.training))
    return hybrid, info


def _say_passthrough(info) -> None:
    """One line when the checkpoint keeps tensors the model does not load (DeepSeek-V3's multi-token prediction)."""
    from toolkit.convert.passthrough import passthrough_notice

    line = passthrough_notice(kind=info.kind, hf_dir=info.hf_dir, patterns=info.settings.passthrough_hf)
    if line:
        print(line, flush=True)


def encoder_batches(*, spec, layout, hf_dir: Path, hf_config):
    """Masked-LM or classification batches for an encoder (BERT); real records only."""
    if spec.data.synthetic:
        raise DsmtError(f"data.synthetic=true: {hf_config.architectures[0]} trains through megatron-core on real "
                        "records only; set data.path (text records, with data.label_field for classification)")
    return task_batches(spec=spec, layout=layout, hf_dir=hf_dir, model_config=hf_config)


def task_batches(*, spec, layout, hf_dir: Path, model_config):
    """Batches of the task of the model's head (toolkit/data/tasks.py: the class in config.architectures[0]). Every
    rank reads and tokenises the records itself (images: decoded per batch; no dsmt data cache); the ranks of one
    data-parallel replica (TP / PP) draw the same rows."""
    from megatron.core import parallel_state

    from toolkit.data.pipeline import require_data_path
    from toolkit.data.tasks import TaskBatches, task_examples

    require_data_path(spec.data)
    examples = task_examples(data=spec.data, model_config=model_config, tokenizer_path=str(hf_dir),
                             seq_length=layout.seq_length, seed=spec.training.seed)
    return TaskBatches(examples=examples, micro_batch_size=layout.micro_batch_size,
                       num_microbatches=layout.grad_accum_steps, dp_rank=parallel_state.get_data_parallel_rank(),
                       dp_size=layout.dp, seed=spec.training.seed, shuffle=spec.data.shuffle)


def _plain_parts(*, spec, layout, hf_dir: Path, ds_config: dict, output_dir: Path):
    """An HF model without a megatron-core adapter: DeepSpeed ZeRO data parallelism only (toolkit/train/plain/engine.py),
    on `data.path` read for the model's task (toolkit/data/tasks.py), or synthetic inputs when data.synthetic
    (a `loop.TrainParts`)."""
    from megatron.core import parallel_state

    from toolkit.train.job.hf_export import export_plain_into
    from toolkit.train.job.loop import TrainParts
    from toolkit.train.plain import engine as plain

    model_type = plain.model_type_of(hf_dir)
    if spec.training.lora is not None:
        raise DsmtError(f"training.lora: model_type {model_type!r} has no megatron-core adapter, and dsmt's LoRA "
                        "acts on the adapters' megatron layers; remove training.lora (full fine-tuning) or use a "
                        "supported family (`dsmt check` lists them)")
    plain.check_plain_layout(tp=layout.tp, pp=layout.pp, model_type=model_type)
    model = plain.load_plain_model(hf_dir, dtype=params_dtype(spec.training.precision))
    if spec.data.synthetic:
        from toolkit.train.plain.synthetic import PlainBatches

        batches = PlainBatches(model_config=model.config, seq_length=layout.seq_length,
                               micro_batch_size=layout.micro_batch_size, num_microbatches=layout.grad_accum_steps,
                               dp_rank=parallel_state.get_data_parallel_rank(), dp_size=layout.dp,
                               seed=spec.training.seed)
    else:
        batches = task_batches(spec=spec, layout=layout, hf_dir=hf_dir, model_config=model.config)
    if spec.training.sync_batchnorm:
        model = plain.convert_sync_batchnorm(model, device=spec.cluster.device)
    engine = plain.PlainEngine(model=model, ds_config=ds_config, lr_schedule=LrSchedule.from_training(spec.training))
    notice = plain.plain_notice(model_type=model_type, zero_stage=spec.parallel.zero_stage)
    return TrainParts(trainer=engine, batches=batches, notice=notice,
                      export=lambda: plain.export_plain(engine=engine.engine, out_dir=output_dir / "final-hf"),
                      export_into=lambda folder: export_plain_into(folder, engine=engine.engine, source_dir=hf_dir))


def _export(*, hybrid, info, spec, output_dir: Path) -> None:
    export_trained(hybrid=hybrid, info=info, precision=spec.training.precision, lora=spec.training.lora,
                   mcore_dir=output_dir / "final-mcore", hf_dir=output_dir / "final-hf",
                   adapter_dir=output_dir / "final-hf-adapter", status_file=output_dir / ".final-hf.status.json")


def run_job(*, job) -> None:
    """One rank of a checked job, to its end: the device, SIGTERM saved and stopped (exit 75), the output directory
    claimed, rank 0 speaking, a heartbeat, the training. `python -m toolkit.train` checks and calls it."""
    from toolkit import backend as backends
    from toolkit.launch.rank_output import LOG_DIR_ENV, quiet_other_ranks
    from toolkit.train.job.preemption import stop_on_sigterm

    spec = job.spec
    backends.select(device=spec.cluster.device)  # CUDA asked for but broken: exit 2 before the run writes anything
    # From here on SIGTERM (preemption, a time limit) stops the ranks after a step, saved, with exit code 75; the
    # output directory is claimed before anything is written there.
    with stop_on_sigterm(), claim_output_dir(spec=spec, allow_changes=job.continue_with_changes):
        log_dir = Path(spec.training.output_dir) / "logs"
        quiet_other_ranks(log_dir=log_dir)  # rank 0 speaks (toolkit/launch/rank_output.py)
        watch_this_rank(log_dir=Path(os.environ.get(LOG_DIR_ENV) or log_dir))
        train(job=job)  # after its last step: nothing to do


def watch_this_rank(*, log_dir: Path) -> None:
    """This rank stops when its launcher dies (toolkit/launch/watchdog.py) and beats its heartbeat into `log_dir`
    (toolkit/launch/heartbeat.py), so that the rank that fails first is the one named."""
    from toolkit.launch import heartbeat, watchdog
    from toolkit.launch.rank_output import this_rank

    watchdog.die_with_parent(what=f"rank {this_rank()}")
    heartbeat.start(log_dir=log_dir, rank=this_rank())


def claim_output_dir(*, spec, allow_changes: bool = False):
    """The output directory's run lock: held by `dsmt train` for its ranks (nothing to do here: it also recorded
    the run's identity). Under a cluster launcher rank 0 takes it (and renews its lease) before any process group
    exists, and every other rank stops first if another launch's live run holds it: a second run exits 2 without
    touching the first one's files. Rank 0 then refuses a spec that would continue another job's checkpoints
    (toolkit/train/job/run_identity.py); the other ranks end with it (their launcher stops them)."""
    import contextlib

    from toolkit.launch import run_lock
    from toolkit.launch.rank_output import this_rank

    output_dir = Path(spec.training.output_dir)
    if run_lock.held_by_launcher(output_dir=output_dir):
        return contextlib.nullcontext()
    if this_rank() != 0:
        run_lock.refuse_another_launch(output_dir=output_dir)
        return contextlib.nullcontext()
    lock = run_lock.acquire(output_dir=output_dir, command="python -m toolkit.train (rank 0)").keep_renewed()
    if lock.took_over:
        print(lock.takeover_line(), flush=True)
    from toolkit.train.job import run_identity

    try:
        accepted = run_identity.admit(spec=spec, allow_changes=allow_changes)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    for line in run_identity.accepted_lines(accepted):
        print(line, flush=True)
    return lock
