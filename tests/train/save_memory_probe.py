"""`python -m toolkit.train` with the layout-free save wrapped to measure each rank's host memory during it: the
kernel's high-water mark (VmHWM) reset just before (`/proc/self/clear_refs` 5) and read just after, against the
resident memory (VmRSS) at its start. Written to $DSMT_SAVE_PROBE/rankN.json with the bytes this rank writes."""

import json
import os
import sys
from pathlib import Path

from toolkit.convert.progress import proc_status_bytes
from toolkit.errors import DsmtError
from toolkit.train.checkpoint import reshard
from toolkit.train.__main__ import main

_save = reshard.LayoutFreeState.save


def measured_save(self, tag_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state

    shards = reshard.trainable_shards(self.chunks)
    values = [param.numel() * 4 for param, _, _ in shards.values()]  # fp32, this rank's TP / PP shard
    # megatron saves SwiGLU's fc1 as two views (gate, up) of one tensor, and torch's checkpoint writer copies a
    # view that does not span its storage before writing it: the writer holds those values twice for a while
    fused = [param.numel() * 4 for key, (param, _, _) in shards.items() if "linear_fc1.weight" in key]
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    baseline = proc_status_bytes("VmRSS")
    _save(self, tag_dir)
    record = {"dp_rank": parallel_state.get_data_parallel_rank(), "peak_above_baseline": proc_status_bytes("VmHWM") - baseline,
              "shard_bytes": 3 * sum(values), "largest_value_bytes": max(values),  # master + two Adam moments
              "fused_view_bytes": 3 * sum(fused)}
    Path(os.environ["DSMT_SAVE_PROBE"], f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    reshard.LayoutFreeState.save = measured_save
    try:
        sys.exit(main())
    except DsmtError as err:
        print(f"dsmt train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
