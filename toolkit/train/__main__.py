"""`python -m toolkit.train --config job.yaml [--run-dir DIR]`: what torchrun, the deepspeed launcher and SLURM start
per rank (the generated scripts pass their run directory: toolkit/train/job/run_files.py)."""

import sys

from toolkit.launch.rank_output import quiet_library_warnings, run_rank

quiet_library_warnings()  # before megatron's imports warn (ranks of the generated scripts, of srun, of mpirun)
from toolkit.train.job.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_rank(main, command="dsmt train"))
