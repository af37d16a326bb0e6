"""megatron's parallel state, in the shape DeepSpeed's `mpu` argument expects.

With it DeepSpeed reduces gradients and partitions ZeRO state over megatron's data-parallel group only, treats
megatron's TP x PP group as "model parallel", and counts TP-replicated parameters (norms) once in the grad norm
(megatron marks split parameters with `tensor_model_parallel=True`, which DeepSpeed reads)."""

from __future__ import annotations


class MegatronMpu:
    def __init__(self):
        from megatron.core import parallel_state

        self._ps = parallel_state

    # data parallel: what ZeRO partitions and reduces over. With context parallelism the CP ranks of one replica
    # hold the same weights and gradients of different sequence chunks, so gradients are reduced (and ZeRO state
    # partitioned) over dp × cp ranks, as megatron's own DDP does (`with_context_parallel=True`).
    def _with_cp(self) -> bool:
        return self._ps.get_context_parallel_world_size() > 1

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group(with_context_parallel=self._with_cp())

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank(with_context_parallel=self._with_cp())

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size(with_context_parallel=self._with_cp())

    # model parallel = tensor x pipeline (megatron's model-parallel group; CP ranks are data-parallel to DeepSpeed)
    def get_model_parallel_group(self):
        return self._ps.get_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(group=self.get_model_parallel_group())

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(group=self.get_model_parallel_group())

    # tensor parallel
    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    # pipeline parallel
    def get_pipeline_model_parallel_group(self):
        return self._ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ps.get_pipeline_model_parallel_world_size()

    def get_sequence_parallel_world_size(self) -> int:
        return 1  # DeepSpeed's Ulysses sequence parallelism is not used
