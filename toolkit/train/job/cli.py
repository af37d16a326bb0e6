"""`dsmt train SPEC` (or `--config SPEC`): checks the spec, then starts the spec's ranks on this machine (torchrun).
`dsmt train --run-dir DIR` trains a `dsmt generate` directory as its scripts do: DIR/job.resolved.yaml is the spec
and DIR/ds_config.json what DeepSpeed receives (edited tuning keys win, layout keys must agree with the spec:
`toolkit/train/job/run_files.py`).
`--dry-run` does every check `dsmt train` would do before launching (`toolkit/train/job/dryrun.py`) and writes nothing.
On a cluster use the generated scripts (`dsmt generate`), which start `python -m toolkit.train` per rank."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a job spec (ranks on this machine); --dry-run checks only")
    parser.add_argument("spec", nargs="?", metavar="JOB", help="job spec (YAML/JSON), as for `dsmt check JOB`")
    parser.add_argument("--config", help="job spec (YAML/JSON); the same as the positional JOB")
    parser.add_argument("--run-dir", type=Path, metavar="DIR",
                        help="a `dsmt generate` directory: its ds_config.json (edited tuning keys win) and "
                             "megatron.json are checked against the spec and used; JOB defaults to "
                             "DIR/job.resolved.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    parser.add_argument("--dry-run", action="store_true",
                        help="check spec, model at this layout (meta device), DeepSpeed config, data and tokenizer; "
                             "exit 0, or 2 listing every problem; writes nothing")
    parser.add_argument("--no-fallback", action="store_true",
                        help="when the newest checkpoint does not match its manifest, stop (exit 2) instead of "
                             "resuming from the newest intact one")
    parser.add_argument("--continue-with-changes", action="store_true",
                        help="continue the run in training.output_dir although the spec changed train_steps, "
                             "min_lr, evaluation or the layout (other changes need a new output_dir)")
    parser.add_argument("--verbose", action="store_true", help="every rank's output and the libraries' warnings "
                        "on the console (default: rank 0 speaks; the others write OUTPUT/logs/rankN.log)")
    parser.set_defaults(func=run)


def spec_path(args) -> str:
    from toolkit.train.job.run_files import spec_path_for

    if args.spec and args.config and args.spec != args.config:
        raise DsmtError(f"two job specs given: JOB={args.spec!r} and --config={args.config!r}; give one "
                        f"(`dsmt train JOB` or `dsmt train --config JOB`)")
    path = args.spec or args.config
    if not path and args.run_dir is None:
        raise DsmtError("no job spec: use `dsmt train JOB.yaml`, `dsmt train --config JOB.yaml` (configs/ has "
                        "examples) or `dsmt train --run-dir DIR` (a `dsmt generate` directory)")
    return spec_path_for(config=path, run_dir=args.run_dir, overrides=args.set)


def run(args) -> int:
    path = spec_path(args)
    if args.dry_run:
        from toolkit.train.job.dryrun import dry_run

        report = dry_run(path, overrides=args.set, run_dir=args.run_dir, allow_changes=args.continue_with_changes)
        print(report.to_text())
        return 0 if report.ok else 2
    launch_training(path=path, overrides=args.set, run_dir=args.run_dir, fallback=not args.no_fallback,
                    allow_changes=args.continue_with_changes)
    return 0


def launch_training(*, path: str, overrides: list[str] | tuple[str, ...] = (), run_dir: Path | None = None,
                    fallback: bool = True, checked: bool = False, allow_changes: bool = False) -> None:
    """Check the spec at `path` (unless the caller just did: `checked`), then run its ranks on this machine and
    wait (`dsmt train`, `toolkit.api.train`). The output directory's run lock is held from before the first rank
    starts until the last one ended; under it the spec is recorded as the directory's job, or refused as another
    job's continuation (`allow_changes`: --continue-with-changes; toolkit/train/job/run_identity.py)."""
    from toolkit.launch.local import launch_local_workers
    from toolkit.spec.layout import world_size_of
    from toolkit.spec.load import load_spec
    from toolkit.train.job import prelaunch

    spec = (load_spec(path, overrides=overrides) if checked else
            prelaunch.checked_before_launch(path=path, overrides=overrides, run_dir=run_dir,
                                            allow_changes=allow_changes))
    from toolkit.train.job.run import require_weights

    require_weights(spec)
    from toolkit import backend as backends

    backends.select(device=spec.cluster.device)  # CUDA asked for but absent: stop here, before any rank starts
    if spec.cluster.nodes > 1:
        raise DsmtError(f"cluster.nodes={spec.cluster.nodes}: `dsmt train` starts ranks on this machine only; "
                        f"run `dsmt generate {path} --out run/` and launch run/launch_deepspeed.sh or job.sbatch")
    from toolkit.generate.env import environment

    from toolkit.launch import run_lock

    sets = [f"--set={item}" for item in overrides]
    run_dir_args = ["--run-dir", str(Path(run_dir).expanduser().absolute())] if run_dir is not None else []
    flags = [] if fallback else ["--no-fallback"]
    output_dir = Path(spec.training.output_dir)
    with run_lock.acquire(output_dir=output_dir, command=f"dsmt train {path}").keep_renewed() as lock:
        if lock.took_over:
            print(lock.takeover_line(), flush=True)
            wait_for_gone_ranks(log_dir=output_dir / "logs")
        from toolkit.train.job import run_identity

        for line in run_identity.accepted_lines(run_identity.admit(spec=spec, allow_changes=allow_changes)):
            print(line, flush=True)
        # The environment the generated scripts export (.deepspeed_env): NCCL presets and
        # CUDA_DEVICE_MAX_CONNECTIONS=1 on GPUs, DS_ACCELERATOR=cpu and one thread per rank on the CPU; the spec's
        # communication.extra_env last; the lock's path, so the ranks do not take it again.
        launch_local_workers(module="toolkit.train", args=["--config", str(path), *run_dir_args, *sets, *flags],
                             nprocs=world_size_of(spec), log_dir=output_dir / "logs",
                             timeout_s=None,  # a training run takes as long as it takes
                             env={**environment(spec=spec), run_lock.LOCK_ENV: str(lock.path)},
                             stop_grace_s=spec.training.preemption_grace_s,
                             hang_timeout_s=spec.training.hang_timeout_s)


def wait_for_gone_ranks(*, log_dir: Path, timeout_s: float = 60.0) -> None:
    """After taking over a dead launcher's lock: its ranks may take a few seconds more to die (torchrun gives them
    30 s after SIGTERM); wait for them, and refuse rather than write beside one that lives on."""
    import time

    from toolkit.launch import heartbeat

    deadline = time.monotonic() + timeout_s
    while (alive := heartbeat.live_on_this_machine(log_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if alive:
        listed = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in alive)
        raise DsmtError(f"[one_run_per_output_dir] the previous run's launcher is gone but {listed} still run "
                        f"after {timeout_s:.0f} s; nothing was started\nfix: stop them (kill PID), then run the same "
                        "command again")
