"""Gradients that are partial on each TP rank and must be summed over the TP group before DeepSpeed sees them
(sequence parallelism's norms, shared q / k head norms, LoRA matrices replicated over TP): which they are, and the
hooks that sum them. Used by both drivers of the hybrid engine (toolkit/train/engine/hybrid.py)."""

from __future__ import annotations

import functools

import torch


def sequence_parallel_params(chunks: list) -> list[torch.nn.Parameter]:
    """Parameters whose gradient is partial on each TP rank, so it must be summed over the TP group (megatron's rule
    in `finalize_model_grads`):
      * under sequence parallelism, those marked `sequence_parallel=True`: each TP rank computes their gradient
        from its own slice of the sequence (the marks come from dsmt's `TorchNorm`, Transformer Engine's norms and
        fused layer-norm linears, apex's norms, megatron's row-parallel biases);
      * with qk_layernorm (Qwen3), the q / k head norms: one weight shared by all heads, and each TP rank holds
        only its own heads, so each computes the gradient from those heads alone (SP or not); not OLMo-2's
        whole-projection q / k norms, whose weight is itself split over TP (`tensor_model_parallel`);
      * parameters marked `tensor_parallel_partial_grad=True` (LoRA matrices replicated over TP whose gradient
        each rank computes from its own shard of the base layer: toolkit/train/lora/adapters.py).
    Empty for chunks built with none of these."""
    found: dict[int, torch.nn.Parameter] = {}
    for chunk in chunks:
        config = getattr(chunk, "config", None)
        sequence_parallel = getattr(config, "sequence_parallel", False)
        qk_layernorm = getattr(config, "qk_layernorm", False)
        for name, param in chunk.named_parameters():
            partial = ((sequence_parallel and getattr(param, "sequence_parallel", False))
                       or (qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
                           # a TP-sharded q / k norm (OLMo-2's, over the whole projection) holds its own heads' slice
                           and not getattr(param, "tensor_model_parallel", False))
                       or getattr(param, "tensor_parallel_partial_grad", False))
            if param.requires_grad and partial:
                found[id(param)] = param
    return list(found.values())


def sum_sequence_parallel_grads(chunks: list, *, tp_group=None) -> list:
    """Sum the gradients of `sequence_parallel_params` over the TP group; returns the hook handles.

    megatron sums them in `finalize_model_grads` for its own DDP, after backward. Here DeepSpeed owns the
    gradients, and at ZeRO-2/3 it reduces (and at bf16 moves) each one over DP in a post-accumulate-grad hook
    during backward, so nothing after backward could come first. A tensor hook on the parameter runs when its
    gradient is computed, before accumulation, so every DeepSpeed stage and both drivers see the TP sum; it also
    fires inside activation recompute's backward. One small all-reduce per norm and micro-batch (norms are
    hidden_size long); sum over micro-batches of TP sums = TP sum of the accumulated gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group=group) == 1:
        return []
    hook = functools.partial(_sum_over_group, group=group)
    return [param.register_hook(hook) for param in sequence_parallel_params(chunks)]


def _sum_over_group(grad: torch.Tensor, *, group) -> torch.Tensor:
    import torch.distributed as dist

    total = grad.to(torch.float32, copy=True)  # a new tensor (hooks must not modify theirs); fp32: one rounding
    dist.all_reduce(total, group=group)
    return total.to(grad.dtype)
