"""LoRA in the planner: the adapter parameters, and what of the model states they change.

With `training.lora` (toolkit/train/lora/adapters.py) every base weight is frozen: DeepSpeed keeps it (whole, or its
partition at ZeRO-3) but gives it no gradient, no fp32 master copy and no Adam moments; those exist for the adapter
matrices only. Each targeted projection W [out, in] gets A [rank, in] and B [out, rank], held whole on every TP rank
(dsmt's LoRA assembles each rank's slice in the forward), so a GPU of a pipeline stage holds rank * (in + out) per
targeted projection of its layers:
  attention      q, k, v, o (Llama-shaped); multi-latent attention's q (no q latent) or q_a [q_lora_rank, h] and
                 q_b [a·(nope+rope), q_lora_rank], kv_a [kv_lora_rank + rope, h], kv_b [a·(nope+v), kv_lora_rank],
                 o [h, a·v]: every layer
  dense MLP      gate, up, down at ffn_hidden_size: the layers that are not MoE layers (all of a dense model;
                 DeepSeek's first_k_dense_replace, Qwen2-MoE's mlp_only_layers)
  shared experts shared_gate, shared_up, shared_down at shared_expert_ffn_hidden_size: every MoE layer
  routed experts expert_gate_up [2f, h] (one adapter on the packed gate and up rows) and expert_down [h, f] per expert:
                 every MoE layer, E / ep experts per GPU (the EP rank's own; whole on every expert-TP rank)
  router         router [E, h] when a target names it (never by default): every MoE layer, whole on every GPU
ZeRO partitions the adapters' states as it does the base weights' (toolkit/plan/experts.py): the routed experts'
over expert_dp = dp × cp / ep, the rest over dp × cp (memory.py `lora_model_states`).

Named approximations: the time model still counts the weight-gradient GEMMs of the frozen layers (LoRA skips them,
about a third of the backward FLOPs), so a LoRA step is predicted slower than it runs; a packed module (Phi-3's
qkv_proj, gate_up_proj) is counted as its separate projections, rank·h more per extra projection than its one
adapter [rank, h] + [out, rank].
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError
from toolkit.models.shapes import ModelShape
from toolkit.plan.layers import stage_layer_kinds

# One name per projection a layer can carry (the planner's shapes have no family names). Each sits in every layer,
# the dense-MLP layers only or the MoE layers only (LAYERS).
ATTENTION = ("q", "k", "v", "o")
MLA = ("q_a", "q_b", "kv_a", "kv_b")  # with q (no q latent) and o
DENSE_MLP = ("gate", "up", "down")
SHARED_EXPERTS = ("shared_gate", "shared_up", "shared_down")
ROUTED_EXPERTS = ("expert_gate_up", "expert_down")  # per expert
ROUTER = ("router",)
PROJECTIONS = ATTENTION[:3] + MLA + ATTENTION[3:] + DENSE_MLP + SHARED_EXPERTS + ROUTER + ROUTED_EXPERTS  # layer order
LAYERS = {**dict.fromkeys(ATTENTION + MLA, "all"), **dict.fromkeys(DENSE_MLP, "dense"),
          **dict.fromkeys(SHARED_EXPERTS + ROUTER + ROUTED_EXPERTS, "moe")}


@dataclasses.dataclass(frozen=True)
class LoraShape:
    rank: int
    projections: frozenset[str] = frozenset(PROJECTIONS)  # which of PROJECTIONS carry an adapter
    train_embeddings: bool = False  # training.lora.train_embeddings: the embedding and output layer train too


@dataclasses.dataclass(frozen=True)
class LoraCount:
    """Adapter parameters, split as ZeRO partitions them: the routed experts' (over expert_dp) and the rest."""

    dense: int = 0
    experts: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.experts

    def __add__(self, other: LoraCount) -> LoraCount:
        return LoraCount(self.dense + other.dense, self.experts + other.experts)


def trained_embedding_params(*, shape: ModelShape, lora: LoraShape, tp: int, pp: int, stage: int) -> int:
    """Embedding parameters one GPU of `stage` trains with `train_embeddings` (vocab-parallel over tp): the input
    embedding on the first stage, the output layer on the last (untied, or the tied copy when pp > 1)."""
    if not lora.train_embeddings:
        return 0
    per_copy = -(-shape.vocab_size // tp) * shape.hidden_size
    copies = (stage == 0) + (stage == pp - 1 and (not shape.tied_embeddings or pp > 1))
    return copies * per_copy


def _attention_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, heads, m = shape.hidden_size, shape.num_attention_heads, shape.mla
    if m is None:
        d, q = shape.kv_channels, shape.num_attention_heads * shape.kv_channels
        kv = shape.num_kv_heads * d
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
    q_out = heads * m.qk_head_dim
    found = {"q_a": (h, m.q_lora_rank), "q_b": (m.q_lora_rank, q_out)} if m.q_lora_rank else {"q": (h, q_out)}
    return found | {"kv_a": (h, m.kv_lora_rank + m.qk_rope_head_dim),
                    "kv_b": (m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                    "o": (heads * m.v_head_dim, h)}


def _mlp_sizes(shape: ModelShape, width: int, names: tuple[str, str, str]) -> dict[str, tuple[int, int]]:
    """gate, up, down of an MLP of `width` (a non-gated MLP has no gate)."""
    h = shape.hidden_size
    sizes = dict(zip(names, ((h, width), (h, width), (width, h))))
    return sizes if shape.gated_mlp else {name: size for name, size in sizes.items() if name != names[0]}


def projection_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection the model's layers have (a routed expert's: one expert's); which layers
    carry each: LAYERS."""
    sizes = _attention_sizes(shape)
    if any(not shape.is_moe_layer(i) for i in range(shape.num_layers)):
        sizes |= _mlp_sizes(shape, shape.ffn_hidden_size, DENSE_MLP)
    if shape.is_moe and shape.shared_expert_ffn_hidden_size:
        sizes |= _mlp_sizes(shape, shape.shared_expert_ffn_hidden_size, SHARED_EXPERTS)
    if shape.is_moe:
        f = shape.moe_ffn_hidden_size
        sizes |= {"router": (shape.hidden_size, shape.num_experts),
                  "expert_gate_up": (shape.hidden_size, f * (2 if shape.gated_mlp else 1)),
                  "expert_down": (f, shape.hidden_size)}
    return sizes


def layer_lora_params(*, shape: ModelShape, lora: LoraShape, moe: bool, experts: int | None = None) -> LoraCount:
    """Adapter parameters of one layer (an MoE layer's when `moe`) on one GPU, holding `experts` of its routed
    experts (default: all). The same on every TP rank: adapters are not split."""
    experts = shape.num_experts if experts is None else experts
    counted = LoraCount()
    for name, (fan_in, fan_out) in projection_sizes(shape).items():
        if name not in lora.projections or LAYERS[name] == ("dense" if moe else "moe"):
            continue
        per_projection = lora.rank * (fan_in + fan_out)
        counted += (LoraCount(experts=experts * per_projection) if name in ROUTED_EXPERTS
                    else LoraCount(dense=per_projection))
    return counted


def lora_params_per_layer(*, shape: ModelShape, lora: LoraShape, moe: bool | None = None) -> int:
    """Adapter parameters of one layer with all its experts (default: an MoE layer of an MoE model)."""
    return layer_lora_params(shape=shape, lora=lora, moe=shape.is_moe if moe is None else moe).total


def lora_params(*, shape: ModelShape, lora: LoraShape) -> int:
    """Adapter parameters of the whole model: every layer, every expert (its dense and MoE layers each counted as
    theirs)."""
    kinds = shape.layer_kinds()
    return sum(count * layer_lora_params(shape=shape, lora=lora, moe=moe).total for (moe, _), count in kinds.items())


def stage_lora_params(*, shape: ModelShape, lora: LoraShape, layout, stage: int) -> LoraCount:
    """Adapter parameters one GPU of pipeline stage `stage` holds: its layers' (dense and MoE as they fall), the
    routed experts' for this EP rank's num_experts / ep experts."""
    experts = shape.num_experts // layout.ep if shape.is_moe else 0
    counted = LoraCount()
    for (moe, _), count in stage_layer_kinds(shape=shape, layout=layout, stage=stage).items():
        one = layer_lora_params(shape=shape, lora=lora, moe=moe, experts=experts)
        counted += LoraCount(dense=count * one.dense, experts=count * one.experts)
    return counted


def default_projections(shape: ModelShape, *, mlp_names_redirected: bool = False) -> frozenset[str]:
    """What dsmt's LoRA adapts with training.lora.targets unset (toolkit/train/lora/targets.py `resolve_targets`):
    every attention projection (multi-latent attention's included) and an MoE model's routed experts; the dense MLP
    and the shared experts too, unless PEFT on transformers 5 reads their names (gate_proj / up_proj / down_proj,
    Mixtral's w1 / w2 / w3) as the fused routed experts (`mlp_names_redirected`: DeepSeek, Qwen3-MoE, GLM-4.5,
    Mixtral), so that dsmt withholds them. A shape without a family (a built-in name) is planned with every
    projection it has: the larger count, by the shared experts' and dense layers' adapters where dsmt would
    withhold them."""
    withheld = set(ROUTER) | (set(DENSE_MLP + SHARED_EXPERTS) if mlp_names_redirected and shape.is_moe else set())
    return frozenset(name for name in projection_sizes(shape) if name not in withheld)


# megatron linear (toolkit/train/lora/targets.py LINEARS) -> the projections its HF modules stand for, by the
# module's transform kind and slot (the row's HF tensor)
_QKV, _GATE_UP, _SHARED = ("q", "k", "v"), ("gate", "up"), ("shared_gate", "shared_up")
_ONE = {"self_attention.linear_proj": "o", "self_attention.linear_q_proj": "q",
        "self_attention.linear_q_down_proj": "q_a", "self_attention.linear_q_up_proj": "q_b",
        "self_attention.linear_kv_down_proj": "kv_a", "self_attention.linear_kv_up_proj": "kv_b",
        "mlp.linear_fc2": "down", "mlp.shared_experts.linear_fc2": "shared_down",
        "mlp.experts.linear_fc1": "expert_gate_up", "mlp.experts.linear_fc2": "expert_down", "mlp.router": "router"}


def projections_of(*, linear: str, kind: str, slot: int) -> tuple[str, ...]:
    """Which PROJECTIONS one HF module of a family's weight table stands for (toolkit/train/lora/targets.py
    LoraModule): a packed q/k/v module (Phi-3's qkv_proj, GPT-2's c_attn) for all three, a packed gate/up for both;
    a routed experts' fused parameter for its projection of every expert."""
    if linear in _ONE:
        return (_ONE[linear],)
    if linear == "self_attention.linear_qkv":
        return _QKV if kind == "qkv_packed" else (_QKV[slot],)
    if linear not in ("mlp.linear_fc1", "mlp.shared_experts.linear_fc1"):
        raise DsmtError(f"LoRA on {linear}: the planner counts no such linear; known: self_attention.linear_qkv, "
                        f"mlp.linear_fc1, mlp.shared_experts.linear_fc1, {', '.join(_ONE)}")
    names = _SHARED if linear == "mlp.shared_experts.linear_fc1" else _GATE_UP
    return {"gate_up_packed": names, "gate_up": (names[slot],)}.get(kind, (names[1],))
