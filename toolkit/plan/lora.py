"""LoRA in the planner: the adapter parameters, and what of the model states they change.

With `training.lora` (toolkit/train/lora/adapters.py) every base weight is frozen: DeepSpeed keeps it (whole, or its
partition at ZeRO-3) but gives it no gradient, no fp32 master copy and no Adam moments; those exist for the adapter
matrices only. Each targeted projection W [out, in] gets A [rank, in] and B [out, rank], held whole on every TP rank
(dsmt's LoRA assembles each rank's slice in the forward), so a GPU of a pipeline stage holds rank * (in + out) per
targeted projection of its layers.

Named approximation: the time model still counts the weight-gradient GEMMs of the frozen layers (LoRA skips them,
about a third of the backward FLOPs), so a LoRA step is predicted slower than it runs.
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError
from toolkit.models.shapes import ModelShape

# One name per HF projection of a Llama-shaped layer (the planner's shapes have no family names).
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraShape:
    rank: int
    projections: frozenset[str] = frozenset(PROJECTIONS)  # which of PROJECTIONS carry an adapter
    train_embeddings: bool = False  # training.lora.train_embeddings: the embedding and output layer train too


def trained_embedding_params(*, shape: ModelShape, lora: LoraShape, tp: int, pp: int, stage: int) -> int:
    """Embedding parameters one GPU of `stage` trains with `train_embeddings` (vocab-parallel over tp): the input
    embedding on the first stage, the output layer on the last (untied, or the tied copy when pp > 1)."""
    if not lora.train_embeddings:
        return 0
    per_copy = -(-shape.vocab_size // tp) * shape.hidden_size
    copies = (stage == 0) + (stage == pp - 1 and (not shape.tied_embeddings or pp > 1))
    return copies * per_copy


def projection_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one layer; a non-gated MLP has no gate."""
    if shape.mla:
        raise DsmtError(f"--lora-rank with {shape.name}: LoRA on multi-latent attention's projections (q / kv down "
                        "and up, o) is not supported by dsmt's LoRA, so the planner does not count it; plan full "
                        "fine-tuning (drop --lora-rank)")
    h, d, f = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * d, shape.num_kv_heads * d
    sizes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
    if not shape.gated_mlp:
        del sizes["gate"]
    return sizes


def lora_params_per_layer(*, shape: ModelShape, lora: LoraShape) -> int:
    """Adapter parameters of one layer (the same on every TP rank: they are not sharded)."""
    return sum(lora.rank * (fan_in + fan_out) for name, (fan_in, fan_out) in projection_sizes(shape).items()
               if name in lora.projections)


def lora_params(*, shape: ModelShape, lora: LoraShape, num_layers: int | None = None) -> int:
    """Adapter parameters of `num_layers` layers (default: the whole model)."""
    layers = shape.num_layers if num_layers is None else num_layers
    return lora_params_per_layer(shape=shape, lora=lora) * layers


# (megatron linear, transform kind, slot of the HF tensor in the table row) -> the projections that module carries
_QKV, _GATE_UP = ("q", "k", "v"), ("gate", "up")


def projections_of(*, linear: str, kind: str, slot: int) -> tuple[str, ...]:
    """Which PROJECTIONS one HF module of a family's weight table stands for (toolkit/train/lora/adapters.py LoraModule):
    a packed q/k/v module (Phi-3's qkv_proj, GPT-2's c_attn) for all three, a packed gate/up for both."""
    if linear.endswith("linear_qkv"):
        return _QKV if kind == "qkv_packed" else (_QKV[slot],)
    if linear.endswith("linear_proj"):
        return ("o",)
    if linear.endswith("linear_fc1"):
        return {"gate_up_packed": _GATE_UP, "gate_up": (_GATE_UP[slot],)}.get(kind, ("up",))
    return ("down",)
