"""`dsmt train --config job.yaml`: checks the spec, then starts the spec's ranks on this machine (torchrun).
On a cluster use the generated scripts (`dsmt generate`), which start `python -m toolkit.train` per rank."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="fine-tune an HF checkpoint (ranks on this machine)")
    parser.add_argument("--config", required=True, help="job spec (YAML/JSON)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    parser.set_defaults(func=run)


def run(args) -> int:
    from toolkit.errors import DsmtError
    from toolkit.launch import launch_local_workers
    from toolkit.spec.checks import check_file
    from toolkit.spec.layout import world_size_of

    spec, report = check_file(args.config, overrides=args.set)
    if spec is None or not report.ok:  # before any process group starts
        raise DsmtError(f"job spec {args.config} does not pass `dsmt check`:\n{report.to_text()}")
    from toolkit.train.run import require_weights

    require_weights(spec)
    if spec.cluster.nodes > 1:
        raise DsmtError(f"cluster.nodes={spec.cluster.nodes}: `dsmt train` starts ranks on this machine only; "
                        f"run `dsmt generate {args.config} --out run/` and launch run/launch_deepspeed.sh or job.sbatch")
    overrides = [f"--set={item}" for item in args.set]
    launch_local_workers(module="toolkit.train", args=["--config", str(args.config), *overrides],
                         nprocs=world_size_of(spec), timeout_s=24 * 3600)
    return 0
