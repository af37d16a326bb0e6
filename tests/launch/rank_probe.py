"""A rank for tests of dsmt's local launcher: says hello on stdout and stderr, then fails as told on one rank.

`python -m rank_probe FAILING_RANK HOW`, HOW one of: dsmt (a DsmtError), bug (a ValueError), killed (SIGKILL),
none. Imports nothing heavy, so a 2-rank launch takes seconds."""

import os
import signal
import sys
import time

from toolkit.errors import DsmtError
from toolkit.launch.rank_output import run_rank, this_rank


def main() -> int:
    failing_rank, how = int(sys.argv[1]), sys.argv[2]
    rank = this_rank()
    print(f"hello on stdout from rank {rank}", flush=True)
    print(f"hello on stderr from rank {rank}", file=sys.stderr, flush=True)
    if rank != failing_rank or how == "none":
        time.sleep(0.5 if how == "none" else 30)  # the failing rank ends the launch; torchrun stops this one
        return 0
    if how == "dsmt":
        raise DsmtError("the probe's spec is wrong on purpose; fix: none needed")
    if how == "bug":
        raise ValueError("an unexpected bug on purpose")
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(run_rank(main, command="probe"))
