"""Stand-in for `toolkit.train` that the launch tests start: joins the gloo group and reports what it saw."""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.spec.load import load_spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)  # the scripts hand the trainer its run directory
    args = parser.parse_args()
    spec = load_spec(args.config)  # the run directory's job.resolved.yaml must load as a spec
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    report = {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
              "all_reduce_sum": total.item(), "spec_ranks": spec.cluster.nodes * spec.cluster.gpus_per_node,
              "run_dir_files": sorted(p.name for p in Path(args.run_dir).glob("*.json")),
              "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "DS_ACCELERATOR")}}
    Path(os.environ["DSMT_PROBE_OUT"], f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
