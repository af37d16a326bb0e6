"""The Gated DeltaNet kernels (Qwen3-Next's linear-attention layers) in plain torch, for machines without the
`fla` (flash-linear-attention) and `causal_conv1d` CUDA kernels: the CPU backend, and any GPU lacking them.

`gated_delta_rule` is the one place that picks, per call: fla's `chunk_gated_delta_rule` for bf16 / fp16 CUDA
tensors where fla imports, the torch chunked rule otherwise. Training needs no recurrent or conv state carried
between calls, so neither function takes or returns one; packed records are run one by one by the caller
(toolkit/adapters/qwen3_next_layers.py).

The gated delta rule, per value head, with S_0 = 0 (S: [k_head_dim, v_head_dim]):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        o_t = S_t^T q_t / sqrt(k_head_dim)
q and k L2-normalised first (in fp32, eps 1e-6 inside the root, as HF's `l2norm` and fla's kernel). The chunked
form computes the same in blocks of `chunk_size` positions: within a block, the unit lower-triangular system
(I + tril(beta K K^T * decay, -1)) U = beta V folds the sequential delta updates into matrix products, and one
scan over blocks carries S (HF modeling_qwen3_next.torch_chunk_gated_delta_rule, fla's chunk kernel).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (eps inside the root, as fla's kernel and HF)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first_fp32(query, key, value, g, beta):
    """[b, s, heads, d] -> [b, heads, s, d] in fp32; q / k heads repeated for the value heads they serve (each key
    head serves num_v_heads / num_k_heads consecutive value heads), q / k L2-normalised, q scaled."""
    repeats = value.shape[2] // key.shape[2]
    if repeats > 1:
        query, key = query.repeat_interleave(repeats, dim=2), key.repeat_interleave(repeats, dim=2)
    query, key, value, g, beta = (t.transpose(1, 2).to(torch.float32).contiguous() for t in (query, key, value, g, beta))
    query, key = l2norm(query), l2norm(key)
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, *, chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule over whole sequences, chunked. query / key [b, s, num_k_heads, dk], value
    [b, s, num_v_heads, dv], g (log decay, <= 0) and beta [b, s, num_v_heads]; q and k are L2-normalised here.
    Returns [b, s, num_v_heads, dv] in query's dtype (computed in fp32)."""
    out_dtype, seq_len = query.dtype, query.shape[1]
    query, key, value, g, beta = _heads_first_fp32(query, key, value, g, beta)
    pad = (chunk_size - seq_len % chunk_size) % chunk_size  # zero-padded positions come after every real one
    query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    batch, heads = query.shape[:2]

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [b, h, s, ...] -> [b, h, chunks, chunk_size, ...]
        return t.reshape(batch, heads, -1, chunk_size, *t.shape[3:])

    query, key, value, g, beta = (blocks(t) for t in (query, key, value, g, beta))
    log_decay = g.cumsum(dim=-1)  # log of the decay from the block's start to each position
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    # decay[i, j] = prod of exp(g) over (j, i], for j <= i; 0 above the diagonal (-inf before the exp: no overflow)
    decay = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    k_beta, v_beta = key * beta.unsqueeze(-1), value * beta.unsqueeze(-1)
    system = (k_beta @ key.transpose(-1, -2)) * decay  # its strict lower part; the solve takes a unit diagonal
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(system, k_beta * log_decay.exp().unsqueeze(-1), upper=False,
                                                 unitriangular=True)
    within = (query @ key.transpose(-1, -2)) * decay
    query_from_start = query * log_decay.exp().unsqueeze(-1)
    key_to_end = key * (log_decay[..., -1:] - log_decay).exp().unsqueeze(-1)
    block_decay = log_decay[..., -1].exp()[..., None, None]
    state = query.new_zeros(batch, heads, key.shape[-1], value.shape[-1])
    outputs = []
    for i in range(query.shape[2]):
        corrected = new_values[:, :, i] - decayed_keys[:, :, i] @ state  # what the old state does not predict
        outputs.append(query_from_start[:, :, i] @ state + within[:, :, i] @ corrected)
        state = state * block_decay[:, :, i] + key_to_end[:, :, i].transpose(-1, -2) @ corrected
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, value.shape[-1])[:, :, :seq_len]
    return out.transpose(1, 2).contiguous().to(out_dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, activation) -> torch.Tensor:
    """Depthwise causal convolution: x [b, channels, s], weight [channels, kernel]; output position t sees inputs
    t - kernel + 1 .. t (zeros before the start), then `activation`. In the weight's dtype, cast back to x's (HF
    causal_conv1d_fn)."""
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), padding=weight.shape[-1] - 1, groups=x.shape[1])
    return activation(out[..., : x.shape[-1]]).to(x.dtype)


@functools.cache
def _fla_rule():
    """fla's chunk_gated_delta_rule where fla imports on a CUDA machine, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except Exception:  # not installed, or built for another torch / CUDA: the torch rule is exact, only slower
        return None
    return fla_rule


def gated_delta_rule(query, key, value, g, beta) -> torch.Tensor:
    """fla's chunk kernel for bf16 / fp16 CUDA tensors where fla imports, the torch chunked rule otherwise (fla
    computes in tf32, or refuses fp32, so fp32 stays on torch). q and k are repeated to the value heads first, as
    megatron-core's GatedDeltaNet does: fla releases before grouped key heads index g and beta by the key heads."""
    fla_rule = _fla_rule() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
    if fla_rule is None:
        return chunk_gated_delta_rule(query, key, value, g, beta)
    repeats = value.shape[2] // key.shape[2]
    if repeats > 1:
        query, key = query.repeat_interleave(repeats, dim=2), key.repeat_interleave(repeats, dim=2)
    out, _ = fla_rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=True)
    return out
