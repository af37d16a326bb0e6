"""megatron-core's torch_dist save without helper processes: the same checkpoint, written by threads.

Why: megatron's `TorchDistSaveShardedStrategy` (0.16) writes through `FileSystemWriterAsync`, which forks one
writer process per bucket and collects their results through `multiprocessing.get_context("spawn").Manager()`. A
spawned Manager re-executes the `__main__` module of the process that saves. Under `api.initialize` that module is
the user's own `train.py`, and most have no `if __name__ == "__main__":` guard: the helper re-runs the script up to
`api.initialize`, blocks there, and the save waits on it forever without a word (issue 46). Forking writers from a
process that runs gloo / NCCL threads is unsafe besides.

This strategy keeps everything megatron decides (its ShardedTensor -> torch translation, its save planner, the
torch_dist metadata that `dist_checkpointing.load` reads at any layout) and hands the write to
`torch.distributed.checkpoint.save` with torch's own `FileSystemWriter`, whose workers are threads of this process.
Nothing re-imports the user's script; the collectives it runs are the process group's, under its timeout."""

from __future__ import annotations

from pathlib import Path


def threaded_save_strategy(*, thread_count: int = 2):
    """A megatron `SaveShardedStrategy` (backend torch_dist, version 1) for `dist_checkpointing.save`."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class ThreadedTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            import torch.distributed.checkpoint as dcp
            from megatron.core.dist_checkpointing.strategies.torch import (
                MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

            translated, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                          self.keep_only_main_replica)
            writer = dcp.FileSystemWriter(str(Path(checkpoint_dir)), thread_count=self.thread_count)
            planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                       flatten_state_dict=False, can_run_decentralized_global_plan=False)
            dcp.save(mcore_to_pyt_state_dict(translated, False), storage_writer=writer, planner=planner)

    return ThreadedTorchDistSave("torch_dist", 1, thread_count=thread_count)
