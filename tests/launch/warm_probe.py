"""A rank for tests/launch/test_warm_ranks.py: prints, as one JSON line, what a rank must get fresh from a
fork of a warm server (megatron's parallel state, RNG streams, environment, argv, sys.path) and what is its own
(the string-hash seed), after one all-reduce to show the process group works; then leaves state behind.
`sleep`: writes pidRANK in the working directory and sleeps, for a launch that times out."""

import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from datasets.fingerprint import generate_random_fingerprint
from megatron.core import parallel_state


def main() -> None:
    if sys.argv[1:] == ["sleep"]:  # for a timeout: say who it is, then outlive the launch
        Path(f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(120)
        return
    fresh_parallel_state = not parallel_state.model_parallel_is_initialized()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    os.write(1, json.dumps({"rank": dist.get_rank(), "sum": total.item(), "fresh_parallel_state": fresh_parallel_state,
                      "hash": hash("dsmt"), "random": random.random(), "fingerprint": generate_random_fingerprint(),
                      "torch_seed": torch.initial_seed(), "threads": torch.get_num_threads(),
                      "marker": os.environ.get("WARM_PROBE_MARKER"), "argv": sys.argv[1:],
                      "path0": sys.path[0], "cwd": os.getcwd()}).encode() + b"\n")  # one write: ranks share the file
    dist.barrier()  # no rank leaves before the others have used the group
    # left behind on purpose: a later launch must not see it
    os.environ["WARM_PROBE_MARKER"] = "left behind"


if __name__ == "__main__":
    main()
