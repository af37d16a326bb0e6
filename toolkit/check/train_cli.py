"""`dsmt train SPEC` (or `--config SPEC`): checks the spec, then starts the spec's ranks on this machine (torchrun).
`dsmt train --run-dir DIR` trains a `dsmt generate` directory as its scripts do: DIR/job.resolved.yaml is the spec
and DIR/ds_config.json what DeepSpeed receives (edited tuning keys win, layout keys must agree with the spec:
`toolkit/train/job/run_files.py`).
`--dry-run` does every check `dsmt train` would do before launching (`toolkit/check/dryrun.py`) and writes nothing.
On a cluster use the generated scripts (`dsmt generate`), which start `python -m toolkit.train` per rank.
Here, on the checks' floor, because the command is checks first: it hands the checked job to the launcher below
(toolkit/train/job/launch.py)."""

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
        from toolkit.check.dryrun import dry_run

        report = dry_run(path, overrides=args.set, run_dir=args.run_dir, allow_changes=args.continue_with_changes)
        print(report.to_text())
        return 0 if report.ok else 2
    from toolkit.check.prelaunch import checked_file_before_launch
    from toolkit.train.job.launch import launch_training

    job = checked_file_before_launch(path=path, overrides=args.set, run_dir=args.run_dir,
                                     allow_changes=args.continue_with_changes, resume_fallback=not args.no_fallback)
    # the ranks read the spec as given; with --set, the resolved spec launch_training writes (OUTPUT_DIR/dsmt_job.yaml)
    launch_training(job=job, spec_file=None if args.set else Path(path), source=path)
    return 0
