"""`python -m toolkit.train` with deepspeed.initialize wrapped to record what each rank's engine was configured
with (DeepSpeed logs its configuration only at INFO, below its default WARNING level). The e2e test of
test_train_run_files.py launches it through the generated script."""

import json
import os
import sys
from pathlib import Path

import deepspeed

from toolkit.errors import DsmtError
from toolkit.train.__main__ import main

_initialize = deepspeed.initialize


def recording_initialize(*args, **kwargs):
    engine, *rest = _initialize(*args, **kwargs)
    record = {"reduce_bucket_size": engine.zero_reduce_bucket_size(), "zero_stage": engine.zero_optimization_stage(),
              "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu()}
    Path(os.environ["DSMT_ENGINE_PROBE"], f"rank{engine.global_rank}.json").write_text(json.dumps(record))
    return (engine, *rest)


if __name__ == "__main__":
    deepspeed.initialize = recording_initialize  # HybridEngine looks it up on the module at call time
    try:
        sys.exit(main())
    except DsmtError as err:
        print(f"dsmt train: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
