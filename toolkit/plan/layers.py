"""What one transformer layer holds on one TP rank, and which layers each pipeline stage holds.

megatron-core's sharding, per layer and TP rank (h hidden, a / g query / KV heads on this rank, d head dim):
  attention      linear_qkv [(a + 2g)·d, h] split by output rows (with tp > num_kv_heads each rank holds one whole
                 KV head), its bias (Qwen2, Seed-OSS, GLM-4.5, GPT-OSS) the same rows; linear_proj [h, a·d] split by
                 input columns, its bias [h] (GPT-OSS) whole; GPT-OSS's sinks [a], one per query head
  MLA            the per-head projections split over heads: linear_q_up_proj [a·(nope+rope), q_lora_rank] (or
                 linear_q_proj [a·(nope+rope), h] without a q latent), linear_kv_up_proj [a·(nope+v), kv_lora_rank],
                 linear_proj [h, a·v]. The down projections linear_q_down_proj [q_lora_rank, h] and
                 linear_kv_down_proj [kv_lora_rank + rope, h] are not per head: the whole tensor on every TP rank,
                 Transformer Engine's `TELinear(parallel_mode="duplicated")` and, in dsmt's local layers, megatron's
                 plain `Linear` (megatron's local default, a column-parallel linear whose output is gathered, gets
                 the shared rope key's gradient wrong at tp > 1: toolkit/adapters/mla.py).
                 The latent norms [q_lora_rank], [kv_lora_rank] are replicated.
  dense MLP      linear_fc1 [g'·f / tp, h] (g' = 2 when gated), linear_fc2 [h, f / tp]
  MoE MLP        router [E, h] (and GPT-OSS's bias [E]) replicated; the shared experts are megatron's SharedExpertMLP, a dense MLP at their
                 width (split over TP, replicated over EP, in the dense data-parallel group), Qwen2-MoE's gate [1, h]
                 replicated; the routed experts are toolkit/plan/experts.py's
  norms          input and pre-MLP norms replicated
  Qwen3-Next     gated attention: linear_qkv's query rows twice as many (query and output gate per head), q / k
                 norms [d] replicated; Gated DeltaNet layers (mixer_shapes.LINEAR): in_proj_qkvz, in_proj_ba,
                 A_log, dt_bias split over whole key-head groups, out_proj by input columns, conv1d and the gated
                 norm whole on every rank (toolkit/adapters/qwen3_next_layers.py)
A stage holds megatron's chunks: the layers cut into pp·vpp equal chunks, stage s holding chunks s, s + pp, ...
An MoE model with dense layers (DeepSeek's first_k_dense_replace), or with layers of different token mixers
(Qwen3-Next's Gated DeltaNet, Llama 4's chunked attention), has stages of different content, so the memory and time
of `representative_stages` are computed: the first stage of each distinct mix of layers, and the last.
"""

from __future__ import annotations

from toolkit.models import shapes
from toolkit.models.mixer_shapes import ATTENTION, LINEAR
from toolkit.models.shapes import ModelShape
from toolkit.plan.activations import heads_per_rank
from toolkit.plan.experts import (expert_params_per_layer_per_gpu, expert_tensors, local_experts,
                                  shared_expert_tensors)

VOCAB_DIVISIBLE_BY = 128  # megatron's --make-vocab-size-divisible-by default; the padded vocab is split by tp
# 1-D parameters: no weight decay, so DeepSpeed's second parameter group (toolkit/train/engine/hybrid.py)
ONE_D_TENSORS = frozenset({"input_layernorm", "pre_mlp_layernorm", "linear_qkv_bias", "q_layernorm", "kv_layernorm",
                           "linear_proj_bias", "attention_sinks", "router_bias", "expert_fc1_bias", "expert_fc2_bias",
                           "k_layernorm", "A_log", "dt_bias", "gdn_norm"})


def padded_vocab_size(*, shape: ModelShape, tp: int) -> int:
    """The adapters' padded vocabulary (toolkit/models/shapes.py), rounded up to a multiple of tp so `// tp` is the
    rows one TP rank holds (a tp that does not divide it is refused by the layout checks anyway)."""
    padded = shapes.padded_vocab_size(shape.vocab_size, multiple=VOCAB_DIVISIBLE_BY)
    return -(-padded // tp) * tp


def mla_tensors(*, shape: ModelShape, tp: int) -> dict[str, int]:
    """Multi-latent attention's tensors on one TP rank (module docstring); the down projections whole."""
    m, h, heads = shape.mla, shape.hidden_size, shape.num_attention_heads // tp
    found = {"linear_proj": heads * m.v_head_dim * h}
    if m.q_lora_rank:
        found.update(linear_q_down_proj=m.q_lora_rank * h, q_layernorm=m.q_lora_rank,
                     linear_q_up_proj=heads * m.qk_head_dim * m.q_lora_rank)
    else:
        found["linear_q_proj"] = heads * m.qk_head_dim * h
    return found | {"linear_kv_down_proj": (m.kv_lora_rank + m.qk_rope_head_dim) * h,
                    "kv_layernorm": m.kv_lora_rank,
                    "linear_kv_up_proj": heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank}


def attention_tensors(*, shape: ModelShape, tp: int, layer_spec: str = "te", mixer: str = ATTENTION) -> dict[str, int]:
    """One layer's token mixer on one TP rank: the attention's tensors, or a Gated DeltaNet's on LINEAR layers."""
    if mixer == LINEAR:
        return shape.linear_attention.tensors(hidden_size=shape.hidden_size, tp=tp)
    if shape.mla:
        return mla_tensors(shape=shape, tp=tp)
    h, d = shape.hidden_size, shape.kv_channels
    heads, groups = heads_per_rank(shape=shape, tp=tp)
    query_rows = 2 * heads if shape.gated_query else heads  # Qwen3-Next: a gate row per query row
    found = {"linear_proj": heads * d * h, "linear_qkv": h * (query_rows + 2 * groups) * d}
    if shape.qk_norm:  # one [d] weight each for the q heads and the k heads, whole on every rank
        found |= {"q_layernorm": d, "k_layernorm": d}
    if shape.qkv_bias:
        found["linear_qkv_bias"] = (heads + 2 * groups) * d
    if shape.output_bias:  # a row-parallel layer's bias is added after the all-reduce: whole on every TP rank
        found["linear_proj_bias"] = h
    if shape.attention_sinks:  # one logit per query head, split with the heads
        found["attention_sinks"] = heads
    return found


def mlp_tensors(*, shape: ModelShape, tp: int, moe: bool) -> dict[str, int]:
    """A dense MLP's tensors, or an MoE layer's router and shared experts (its routed experts: expert_tensors)."""
    if moe:
        router = {"router": shape.num_experts * shape.hidden_size}
        router |= {"router_bias": shape.num_experts} if shape.expert_bias else {}
        return router | shared_expert_tensors(shape=shape, tp=tp)
    f = shape.ffn_hidden_size // tp
    return {"linear_fc1": shape.hidden_size * f * (2 if shape.gated_mlp else 1), "linear_fc2": f * shape.hidden_size}


def layer_tensors(*, shape: ModelShape, tp: int, moe: bool | None = None, layer_spec: str = "te",
                  mixer: str = ATTENTION) -> dict[str, int]:
    """One transformer layer's parameter tensors on one TP rank, elements each, in megatron-core's module order
    (linear_proj is built before linear_qkv; the ZeRO partition overlap depends on it), an MoE layer's when `moe`
    (default: when the model is MoE; its routed experts are `expert_tensors`, E / ep of them per rank), with the
    token mixer `mixer` (mixer_shapes.LINEAR: a Gated DeltaNet)."""
    moe = shape.is_moe if moe is None else moe
    h = shape.hidden_size
    return (attention_tensors(shape=shape, tp=tp, layer_spec=layer_spec, mixer=mixer)
            | mlp_tensors(shape=shape, tp=tp, moe=moe)
            | {"input_layernorm": h, "pre_mlp_layernorm": h})


def stage_layer_indices(*, shape: ModelShape, layout, stage: int) -> list[int]:
    """The global layers pipeline stage `stage` holds (its vpp chunks, in model order)."""
    chunks = layout.pp * layout.vpp
    per_chunk = shape.num_layers // chunks
    return [chunk * per_chunk + i for chunk in range(stage, chunks, layout.pp) for i in range(per_chunk)]


def stage_layer_counts(*, shape: ModelShape, layout, stage: int) -> tuple[int, int]:
    """(dense layers, MoE layers) of a stage. When every layer is alike, num_layers // pp of them (a published
    uneven split, which the planner only times, holds at least that many)."""
    if not shape.dense_layers:
        layers = shape.num_layers // layout.pp
        return (0, layers) if shape.is_moe else (layers, 0)
    layers = stage_layer_indices(shape=shape, layout=layout, stage=stage)
    moe = sum(shape.is_moe_layer(i) for i in layers)
    return len(layers) - moe, moe


def stage_layer_kinds(*, shape: ModelShape, layout, stage: int) -> dict[tuple[bool, str], int]:
    """(is an MoE layer, token mixer) -> how many layers of that kind stage `stage` holds; a model whose layers all
    mix alike is counted as `stage_layer_counts` does."""
    if not shape.mixed_layers:
        dense, moe = stage_layer_counts(shape=shape, layout=layout, stage=stage)
        mixer = shape.layer_mixer(0)
        return {kind: count for kind, count in (((False, mixer), dense), ((True, mixer), moe)) if count}
    return shape.layer_kinds(stage_layer_indices(shape=shape, layout=layout, stage=stage))


def representative_stages(*, shape: ModelShape, layout) -> list[int]:
    """The stages whose memory or time can be the largest: the first, the last, and the first of each distinct mix
    of layer kinds (a later stage with the same layers holds fewer micro-batches and no output layer)."""
    found, seen = {0, layout.pp - 1}, set()
    if shape.dense_layers or shape.mixed_layers:
        for stage in range(layout.pp):
            counts = tuple(sorted(stage_layer_kinds(shape=shape, layout=layout, stage=stage).items()))
            if counts not in seen:
                seen.add(counts)
                found.add(stage)
    return sorted(found)


def stage_tensors(*, shape: ModelShape, layout, stage: int, layer_spec: str = "te") -> list[tuple[str, int, int]]:
    """(name, elements on one GPU, how many) of every parameter tensor of pipeline stage `stage` (0-based).

    Embedding on the first stage, final norm and output layer on the last. A tied output layer is the embedding
    itself at pp=1; at pp>1 the last stage keeps its own copy, kept equal by an all-reduce (megatron)."""
    kinds = stage_layer_kinds(shape=shape, layout=layout, stage=stage)
    found = []
    for (is_moe, mixer), count in kinds.items():
        tensors = layer_tensors(shape=shape, tp=layout.tp, moe=is_moe, layer_spec=layer_spec, mixer=mixer)
        found += [(name, numel, count) for name, numel in tensors.items()]
    moe = sum(count for (is_moe, _), count in kinds.items() if is_moe)
    if moe:
        experts = moe * local_experts(shape=shape, ep=layout.ep)
        found += [(name, numel, experts) for name, numel in expert_tensors(shape=shape, tp=layout.tp).items()]
    vocab_rows = padded_vocab_size(shape=shape, tp=layout.tp) // layout.tp
    if stage == 0:
        found.append(("embedding", vocab_rows * shape.hidden_size, 1))
    if stage == layout.pp - 1:
        found.append(("final_layernorm", shape.hidden_size, 1))
        if not shape.tied_embeddings or layout.pp > 1:
            found.append(("output_layer", vocab_rows * shape.hidden_size, 1))
    return found


def stage_params_per_gpu(*, shape: ModelShape, layout, stage: int, layer_spec: str = "te") -> int:
    """Parameters held by one GPU of pipeline stage `stage` (0-based)."""
    return sum(numel * count for _, numel, count in stage_tensors(shape=shape, layout=layout, stage=stage,
                                                                  layer_spec=layer_spec))


def layer_params_per_gpu(*, shape: ModelShape, tp: int, ep: int = 1, moe: bool | None = None,
                         layer_spec: str = "te", mixer: str = ATTENTION) -> int:
    """One transformer layer's parameters on one TP (and EP) rank, its routed experts included."""
    moe = shape.is_moe if moe is None else moe
    experts = expert_params_per_layer_per_gpu(shape=shape, tp=tp, ep=ep) if moe else 0
    return sum(layer_tensors(shape=shape, tp=tp, moe=moe, layer_spec=layer_spec, mixer=mixer).values()) + experts


def stage_expert_params_per_gpu(*, shape: ModelShape, layout, stage: int) -> int:
    """The routed experts' share of a pipeline stage's parameters on one rank (its MoE layers' E / ep experts)."""
    _, moe = stage_layer_counts(shape=shape, layout=layout, stage=stage)
    return moe * expert_params_per_layer_per_gpu(shape=shape, tp=layout.tp, ep=layout.ep)
