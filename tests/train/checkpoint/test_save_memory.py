"""Host memory of a checkpoint's layout-free copy (toolkit/train/checkpoint/reshard.py): the fp32 master weights and both Adam
moments are gathered over DP by DeepSpeed on every replica, but kept in host memory only where megatron's
dist_checkpointing writes them (DP rank 0). Before, every replica held a full copy at every save (~24 GB per rank
at 8B, TP2 x PP2). Two DP ranks, ZeRO-1, fp32, a 25M-parameter Llama (a 290 MB shard, far above RSS noise),
one save, each rank's peak resident memory above its baseline measured around the save (save_memory_probe.py)."""

import json

import pytest

from train_helpers import write_spec

pytestmark = pytest.mark.multiproc
BUFFER_SLACK = 32 * 2**20  # dist_checkpointing's own buffers, metadata, threads: observed ~12 MiB


def test_only_the_writing_replica_holds_the_layout_free_copy(tmp_path):
    from ranks import run_on_ranks

    from toolkit.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                 seed=3)
    spec = write_spec(tmp_path / "job.yaml", model_dir=model, output_dir=tmp_path / "out", dp=2, zero=1,
                      global_batch=2, micro=1, steps=1, checkpoint_interval=1, seq=16)
    probe = tmp_path / "probe"
    probe.mkdir()
    run_on_ranks("tests/train/save_memory_probe.py", "--config", str(spec), nprocs=2,
                 # glibc's dynamic mmap threshold keeps freed large buffers in the heap, so the high-water mark
                 # would add up transients; a fixed threshold returns each to the OS when it is freed
                 env={"DSMT_SAVE_PROBE": str(probe), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    ranks = sorted((json.loads(path.read_text()) for path in probe.glob("rank*.json")), key=lambda r: r["dp_rank"])
    writer, other = ranks
    print(f"\nsave peak above baseline: writer {writer['peak_above_baseline'] / 2**20:.0f} MiB, other replica "
          f"{other['peak_above_baseline'] / 2**20:.0f} MiB (shard {writer['shard_bytes'] / 2**20:.0f} MiB)")
    assert writer["shard_bytes"] > 4 * BUFFER_SLACK  # the shard dwarfs the noise, so the bound below means something
    assert other["peak_above_baseline"] <= writer["largest_value_bytes"] + BUFFER_SLACK
    # the writer: its shard, plus the copies torch's writer makes of the fused fc1 views (save_memory_probe.py)
    assert writer["peak_above_baseline"] <= (writer["shard_bytes"] + writer["fused_view_bytes"]
                                             + writer["largest_value_bytes"] + BUFFER_SLACK)
