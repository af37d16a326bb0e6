"""`python -m toolkit.train --config job.yaml [--run-dir DIR]`: what torchrun, the deepspeed launcher and SLURM start
per rank (the generated scripts pass their run directory: toolkit/train/run_files.py)."""

import sys

from toolkit.errors import DsmtError
from toolkit.train.run import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except DsmtError as err:
        print(f"dsmt train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
