"""Activation bytes a GPU holds for backward: per transformer layer, and the output layer with the loss.

The per-layer count follows Korthikanti et al. 2022 ("Reducing activation recomputation", section 4, Table 2): list
the tensors autograd keeps and add their bytes, with the real widths of grouped-query attention and SwiGLU. Two
layer implementations (Assumptions.layer_spec) and two attention kernels (Assumptions.attention) differ in what they
keep, per token of one TP rank (h hidden, d head dim, a / g query / KV heads and f FFN width on this rank, ab bytes
per activation element):

  norms          te: the input (ab·h) each; local (torch RMSNorm): an fp32 copy of the input, the fp32 normalised
                 input and an fp32 rsqrt per token (8h + 4), whatever ab
  linear inputs  QKV and FC1 keep their input, the norm output (ab·h each); the output projection its input (ab·a·d)
  RoPE           dsmt runs the unfused RoPE (apply_rope_fusion off): q and k rotated copies, and per micro-batch the
                 cos and sin tensors of q and k (4·s·d·ab)
  fused attn.    q, k, v (ab·(a + 2g)·d) and the fp32 log-sum-exp per head (4a)
  local attn.    megatron's DotProductAttention: q (ab·a·d); k and v repeated to a heads (2·ab·a·d) when g < a,
                 else k and the whole QKV output v is a view of (ab·(a + 2g)·d); the fp32 softmax output
                 (4·a·s), the 16-bit probabilities bmm keeps (ab·a·s, when ab < 4), and the boolean causal mask
                 (s² per micro-batch). A fused softmax kernel keeps only ab·a·s; dropout adds its mask (a·s) and
                 output. The scores are computed into megatron's preallocated GlobalMemoryBuffer (once per rank).
  MLP            te: fc1 output and activation output (gated: 2f + f elements); local gated (megatron's glu): fc1
                 output, silu output, the `x_linear + offset` copy and their product (5f elements)
  MoE MLP        (toolkit/plan/experts.py) the router's fp32 probabilities (4E, on the rank's own tokens: split by
                 SP like the norms), and per token k routed copies, each the experts' input (ab·h) and the MLP
                 tensors above at the expert width f = moe_ffn_hidden_size / tp; the routed tokens are gathered
                 over TP before the experts, so they are not split by SP. The busiest EP rank holds
                 r = min(router_imbalance, ep) times the mean copies: k·r·(ab·h + MLP(f)) per token. Shared
                 experts: the MLP tensors at their width / tp on every token (their input is the MoE layer's);
                 Qwen2-MoE's gated one also its output and the sigmoid gate (ab·(h + 1), split by SP)
  MLA            (multi_latent_attention.py, non-absorbed training path) on the rank's own tokens (split by SP): each
                 latent [q_lora_rank], [kv_lora_rank] as its norm's input and the up projection's input (ab·r + norm);
                 per head the contiguous query and key [nope + rope] and value [v] copies the core attention
                 keeps, whichever kernel (ab·a·(2(nope + rope) + v)); the output projection's input ab·a·v; RoPE's
                 cos / sin at the rope dims (4·s·rope·ab). The up projections' outputs are freed (split views, then
                 copies)
  Qwen3-Next     gated attention also keeps the output gate's sigmoid and the core output its product reads
                 (2·ab·a·d); RoPE turns rotary_fraction of each head. Gated DeltaNet layers have no s x s tensors
                 and no RoPE: GatedDeltaNetShape.activation_bytes_per_token (toolkit/models/mixer_shapes.py), split
                 over TP with the heads, in place of q, k, v, the scores and the output projection's input
  Llama 4        chunked attention keeps what full attention keeps: megatron's local attention computes all s x s
                 scores and masks those outside the chunk (toolkit/adapters/families/llama4.py), and a fused kernel
                 keeps none at any span
Selective recompute re-runs core attention: its inputs stay (q, k and the QKV output v is a view of), its s x s
tensors do not. Full recompute keeps each layer's input (and the fp32 RoPE frequencies once). In backward the
layer being recomputed holds again what it does not keep (memory.py adds it once per stage).
Sequence parallelism splits the h-sized tensors over TP; context parallelism gives a rank s / cp tokens.
The local figures are checked against megatron-core's forward on CPU (tests/plan/test_measured.py).
"""

from __future__ import annotations

from toolkit.models.mixer_shapes import ATTENTION, LINEAR
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.experts import router_activation_bytes, routed_activation_bytes
from toolkit.models.shapes import ModelShape

DEFAULT_ASSUMPTIONS = Assumptions()
LOSS_BYTES_PER_TOKEN = 9  # megatron's cross entropy keeps target_mask (bool) and masked_target (int64)
ROPE_FREQ_BYTES = 4  # the fp32 RoPE frequencies [s, 1, 1, d] every full-recompute checkpoint keeps as an argument


def heads_per_rank(*, shape: ModelShape, tp: int) -> tuple[int, int]:
    """(query heads, KV groups) on one TP rank; with tp > num_kv_heads each rank holds one replicated KV head."""
    return shape.num_attention_heads // tp, max(shape.num_kv_heads // tp, 1)


def _norm_bytes(*, h: int, a: Assumptions) -> int:
    """One norm's own stored tensors per token (its output is counted as the next linear's input)."""
    return 8 * h + 4 if a.layer_spec == "local" else a.activation_bytes * h


def _mlp_bytes(*, shape: ModelShape, tp: int, a: Assumptions, moe: bool, ep: int = 1) -> int:
    """The MLP's per-token tensors on one TP rank (an MoE layer's: its busiest EP rank's routed copies and the shared
    experts, a dense MLP at their width)."""
    if moe:
        per_copy = _ffn_bytes(ffn_width=shape.moe_ffn_hidden_size // tp, gated=shape.gated_mlp, a=a)
        shared = _ffn_bytes(ffn_width=shape.shared_expert_ffn_hidden_size // tp, gated=shape.gated_mlp, a=a)
        return int(routed_activation_bytes(shape=shape, ep=ep, mlp_bytes_per_copy=per_copy, assumptions=a)) + shared
    return _ffn_bytes(ffn_width=shape.ffn_hidden_size // tp, gated=shape.gated_mlp, a=a)


def _ffn_bytes(*, ffn_width: int, gated: bool, a: Assumptions) -> int:
    f = ffn_width
    if not gated:
        return 2 * f * a.activation_bytes
    return (5 if a.layer_spec == "local" else 3) * f * a.activation_bytes


def _qkv_bytes(*, shape: ModelShape, tp: int, a: Assumptions, selective: bool) -> int:
    """q, k, v as the attention (or, under selective recompute, its checkpoint) keeps them, per token."""
    heads, groups = heads_per_rank(shape=shape, tp=tp)
    d, ab = shape.kv_channels, a.activation_bytes
    if shape.mla:  # MLA hands the core contiguous query, key [a, nope+rope] and value [a, v] copies, kept by any kernel
        return ab * heads * (2 * shape.qk_head_dim + shape.v_head_dim)
    if a.attention == "fused":
        return ab * (heads + 2 * groups) * d
    qkv_output = ab * (heads + 2 * groups) * d  # v is a view of it
    if selective or groups == heads:
        return ab * (heads + groups) * d + qkv_output  # RoPE's q and k, and the QKV output behind v
    return 3 * ab * heads * d  # RoPE's q, and k and v repeated to every query head


def _score_bytes(*, shape: ModelShape, tp: int, keys: int, a: Assumptions) -> int:
    """The attention core's per-token tensors that scale with the `keys` attended to (no recompute)."""
    heads = shape.num_attention_heads // tp
    if a.attention == "fused":
        return 4 * heads  # fp32 log-sum-exp per head
    ab = a.activation_bytes
    if a.softmax_fusion:  # the fused kernel keeps its 16-bit output, which bmm (or dropout) reads
        softmax, probs_copy = ab, 0
    else:  # fp32 softmax output, then the 16-bit probabilities bmm keeps (the same tensor in an fp32 run)
        softmax, probs_copy = 4, (ab if ab < 4 else 0)
    after_softmax = (1 + ab) if a.dropout else probs_copy  # dropout: its mask and its output, which bmm keeps
    return heads * keys * (softmax + after_softmax)


def _gate_bytes(*, shape: ModelShape, tp: int, a: Assumptions) -> int:
    """Qwen3-Next's output gate: its sigmoid output and the core output, both kept by their product."""
    return 2 * a.activation_bytes * (shape.num_attention_heads // tp) * shape.kv_channels if shape.gated_query else 0


def _latent_bytes(*, shape: ModelShape, a: Assumptions) -> int:
    """MLA's latents per token (on the rank's own tokens: split by SP): each latent norm's input and its output,
    which the up projection keeps."""
    if not shape.mla:
        return 0
    widths = [w for w in (shape.mla.q_lora_rank, shape.mla.kv_lora_rank) if w]
    return sum(_norm_bytes(h=w, a=a) + a.activation_bytes * w for w in widths)


def _moe_replicated_bytes(*, shape: ModelShape, a: Assumptions) -> int:
    """An MoE layer's per-token tensors on the rank's own tokens: the router probabilities and, with Qwen2-MoE's
    gate, the shared expert's output and its sigmoid gate, both kept by the product."""
    gate = a.activation_bytes * (shape.hidden_size + 1) if shape.shared_expert_gate else 0
    return router_activation_bytes(shape) + gate


def activation_bytes_per_layer(*, shape: ModelShape, seq_length: int, micro_batch_size: int, tp: int,
                               sequence_parallel: bool, recompute: str, assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                               cp: int = 1, ep: int = 1, moe: bool | None = None, mixer: str = ATTENTION) -> int:
    """Stored activations of one transformer layer for one micro-batch on one TP (and CP, EP) rank (an MoE layer's
    when `moe`, by default when the model is MoE; a Gated DeltaNet layer's when `mixer` is LINEAR)."""
    a, h = assumptions, shape.hidden_size
    moe = shape.is_moe if moe is None else moe
    s = seq_length // cp
    tokens, ab = s * micro_batch_size, a.activation_bytes
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * h * ab // sp_div
    heads, _ = heads_per_rank(shape=shape, tp=tp)
    selective = recompute == "selective"
    replicated = 2 * _norm_bytes(h=h, a=a) + 2 * ab * h + (2 * h if a.dropout else 0) + _latent_bytes(shape=shape, a=a)
    if moe:
        replicated += _moe_replicated_bytes(shape=shape, a=a)
    mlp = _mlp_bytes(shape=shape, tp=tp, a=a, moe=moe, ep=ep)
    if mixer == LINEAR:  # no scores, no RoPE; the same under selective recompute (it re-runs softmax attention only)
        return tokens * replicated // sp_div + tokens * (
            shape.linear_attention.activation_bytes_per_token(tp=tp, activation_bytes=ab) + mlp)
    split = (_qkv_bytes(shape=shape, tp=tp, a=a, selective=selective) + ab * heads * shape.v_head_dim + mlp
             + _gate_bytes(shape=shape, tp=tp, a=a))
    per_micro_batch = 4 * s * shape.rope_dim * ab  # RoPE cos / sin of q and k
    if not selective:
        split += _score_bytes(shape=shape, tp=tp, keys=seq_length, a=a)
        if a.attention == "local" and not a.softmax_fusion:
            per_micro_batch += s * seq_length  # the boolean causal mask of the unfused softmax
    return tokens * replicated // sp_div + tokens * split + per_micro_batch


def output_layer_activation_bytes(*, shape: ModelShape, tp: int, sequence_parallel: bool, seq_length: int,
                                  micro_batch_size: int, padded_vocab: int,
                                  assumptions: Assumptions = DEFAULT_ASSUMPTIONS, cp: int = 1) -> int:
    """Last stage, one micro-batch at the peak of its loss (its backward follows at once).

    The final norm and the output layer keep their inputs. The loss (toolkit/train/engine/loss.py) then holds, per token
    and vocabulary row of this rank: the 16-bit logits (kept by the caller through backward; the padded rows are
    masked in place) and megatron's fp32 upcast in vocab_parallel_cross_entropy, which it turns in place into the
    softmax it saves (tensor_parallel/cross_entropy.py); an fp32 run's upcast is the logits themselves. Backward
    begins above that, and is the peak: the softmax becomes the fp32 gradient in place and, while the logits are
    still held, its 16-bit cast joins it (16-bit runs), or (fp32 runs, where logits, softmax and gradient are one
    tensor) two full-size copies as the output layer's backward makes the transposed gradient contiguous for its
    two matmuls (measured by tests/plan/test_measured.py, not derived)."""
    a, h, ab = assumptions, shape.hidden_size, assumptions.activation_bytes
    tokens = seq_length // cp * micro_batch_size
    inputs = (_norm_bytes(h=h, a=a) + ab * h) // (tp if sequence_parallel else 1)
    vocab_rows = padded_vocab // tp
    logits = ab + 4 + (ab if ab < 4 else 4)  # the start of backward: logits, fp32 gradient, its cast or copies
    return tokens * (inputs + vocab_rows * logits + LOSS_BYTES_PER_TOKEN)
