"""`python -m toolkit.train --config job.yaml [--run-dir DIR]`: what torchrun, the deepspeed launcher and SLURM start
per rank (the generated scripts pass their run directory: toolkit/train/job/run_files.py). An entry point, on the
top floor with the command line: it checks the spec (toolkit/check/job.py `rank_job`) and hands the checked job to
the rank's run (toolkit/train/job/run.py `run_job`)."""

import argparse
import sys
from pathlib import Path

from toolkit.launch.rank_output import quiet_library_warnings, run_rank

quiet_library_warnings()  # before megatron's imports warn (ranks of the generated scripts, of srun, of mpirun)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.train")
    parser.add_argument("--config", help="job spec (YAML/JSON); default RUN_DIR/job.resolved.yaml")
    parser.add_argument("--run-dir", type=Path, help="the `dsmt generate` directory: its ds_config.json is what "
                        "DeepSpeed receives, checked against the spec first (toolkit/train/job/run_files.py)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    parser.add_argument("--no-fallback", action="store_true", help="stop when the newest checkpoint is damaged "
                        "instead of resuming from the newest intact one")
    parser.add_argument("--continue-with-changes", action="store_true", help="continue the run in "
                        "training.output_dir although train_steps, min_lr, evaluation or the layout changed")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    from toolkit.parallel.groups import adopt_mpi_ranks

    adopt_mpi_ranks()  # under mpirun: RANK & co. from OMPI_COMM_WORLD_*, before anything reads them
    from toolkit.check.job import rank_job
    from toolkit.train.job.run import run_job

    job = rank_job(config=args.config, overrides=args.set, run_dir=args.run_dir, resume_fallback=not args.no_fallback,
                   continue_with_changes=args.continue_with_changes)
    run_job(job=job)
    return 0


if __name__ == "__main__":
    sys.exit(run_rank(main, command="dsmt train"))
