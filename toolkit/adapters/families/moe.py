"""What the mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE) share: the megatron-core MoE settings read from an HF
config, and the refusals for what megatron-core cannot reproduce. Not a family itself (registers nothing).

Routing (HF modeling_mixtral / modeling_qwen3_moe): p = softmax(router logits) over all experts in fp32, the top k
kept, then renormalised to sum to 1 (Mixtral always; Qwen3-MoE when `norm_topk_prob`). megatron-core's softmax router
gives the same weights with `moe_router_pre_softmax=False` (softmax over the top-k logits = renormalised top-k of the
full softmax) and, without renormalisation, with `moe_router_pre_softmax=True` (docs/moe-notes.md, 4).

The load-balancing loss: HF adds `router_aux_loss_coef × aux` to the loss only when the config says
`output_router_logits: true` (its default is false), with aux = E × sum_i f_i × P_i pooled over all layers' routing
(f_i: share of top-k assignments to expert i, summing to k; P_i: mean router probability). megatron-core adds one
term per MoE layer, `coeff × E / (k T^2) × sum_i c_i P_i` = coeff / k × (HF's aux of that layer alone), and sums the
layers. So `coeff = router_aux_loss_coef × k / (MoE layers)` makes megatron's sum the mean over the MoE layers of
HF's per-layer term (Qwen2-MoE's dense layers route nothing): HF's pooled value exactly for one MoE layer, and within the spread of the layers' routing statistics otherwise
(docs/moe-notes.md, 4.1: 2.013562 mean of per-layer terms vs 2.012190 pooled on a 2-layer model).
"""

from __future__ import annotations

from toolkit.adapters.family import WeightMapping
from toolkit.adapters.families.llama import LLAMA_WEIGHTS
from toolkit.adapters.transforms import Kind

# Llama's rows without its dense MLP: attention, both norms (the MLP norm keeps its fused-layer name in an MoE
# layer too), embedding and final norm.
_DENSE_MLP = ("decoder.layers.*.mlp.linear_fc1.weight", "decoder.layers.*.mlp.linear_fc2.weight")
LLAMA_WITHOUT_MLP = tuple(row for row in LLAMA_WEIGHTS if row.megatron not in _DENSE_MLP)


def expert_rows(*, router: str, gate: str, up: str, down: str, layers: str = "all") -> tuple[WeightMapping, ...]:
    """An MoE layer's rows from its HF names (`*` = layer, then expert): the router [E, h] on every TP rank, each
    expert a SwiGLU MLP as a dense layer's (fused [gate; up] column-parallel, down row-parallel). `layers="moe"`
    where dense layers mix in (`WeightMapping.layers`)."""
    return (
        WeightMapping("decoder.layers.*.mlp.router.weight", Kind.REPLICATED, (router,), layers=layers),
        WeightMapping("decoder.layers.*.mlp.experts.*.linear_fc1.weight", Kind.GATE_UP, (gate, up), layers=layers),
        WeightMapping("decoder.layers.*.mlp.experts.*.linear_fc2.weight", Kind.ROW, (down,), layers=layers),
    )


def shared_expert_rows(*, hf_prefix: str) -> tuple[WeightMapping, ...]:
    """The rows of an MoE layer's shared-expert MLP (megatron's `SharedExpertMLP`) from the HF module `hf_prefix`
    (`*` = layer) holding gate_proj / up_proj / down_proj."""
    return (
        WeightMapping("decoder.layers.*.mlp.shared_experts.linear_fc1.weight", Kind.GATE_UP,
                      (f"{hf_prefix}.gate_proj.weight", f"{hf_prefix}.up_proj.weight"), layers="moe"),
        WeightMapping("decoder.layers.*.mlp.shared_experts.linear_fc2.weight", Kind.ROW,
                      (f"{hf_prefix}.down_proj.weight",), layers="moe"),
    )


# Llama's MLP rows, for the dense layers of a model whose other layers are MoE (DeepSeek, Qwen2-MoE).
DENSE_MLP = tuple(WeightMapping(row.megatron, row.kind, row.hf, layers="dense") for row in LLAMA_WEIGHTS
                  if row.megatron in _DENSE_MLP)


def moe_layer_pattern(hf_config) -> list[int]:
    """megatron's `moe_layer_freq` list (1 = MoE layer, 0 = dense) of a config with dense layers among its MoE
    ones, by the planner's reading of the same fields (toolkit/models/moe_shapes.py: DeepSeek's
    `first_k_dense_replace`, Qwen2-MoE's `mlp_only_layers` / `decoder_sparse_step`)."""
    from toolkit.models.moe_shapes import dense_layer_indices

    num_layers = hf_config.num_hidden_layers
    dense = set(dense_layer_indices(hf_config.to_dict(), num_layers=num_layers))
    return [int(i not in dense) for i in range(num_layers)]


def moe_fields(hf_config, *, num_experts: int, ffn_hidden_size: int, renormalise: bool,
               num_moe_layers: int | None = None) -> dict:
    """The TransformerConfig fields of an MoE decoder whose experts are SwiGLU MLPs of `ffn_hidden_size`
    (`num_moe_layers`: how many layers are MoE, all by default)."""
    num_moe_layers = hf_config.num_hidden_layers if num_moe_layers is None else num_moe_layers
    topk = hf_config.num_experts_per_tok
    aux_on = bool(getattr(hf_config, "output_router_logits", False)) and hf_config.router_aux_loss_coef > 0
    return dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=ffn_hidden_size,
        ffn_hidden_size=ffn_hidden_size,  # every layer is MoE; megatron reads it for dense layers only
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not renormalise,
        moe_router_dtype="fp32",  # HF computes the routing softmax in fp32
        moe_grouped_gemm=False,  # SequentialMLP: one MLP per local expert (grouped GEMM needs CUDA kernels)
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss" if aux_on else "none",
        moe_aux_loss_coeff=hf_config.router_aux_loss_coef * topk / num_moe_layers if aux_on else 0.0,
    )


def moe_problems(hf_config, *, renormalise: bool) -> list[str]:
    """Routing megatron-core's router cannot reproduce."""
    problems = []
    topk = hf_config.num_experts_per_tok
    if topk == 1 and renormalise:
        problems.append("num_experts_per_tok=1 with renormalised top-k weights (each token's one expert weighted "
                        "1.0): megatron-core's softmax router refuses top-1 without pre-softmax and otherwise weighs "
                        "the expert by its probability. Fix: none in dsmt; such checkpoints are not supported")
    jitter = getattr(hf_config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        problems.append(f"router_jitter_noise={jitter}: HF multiplies the router input by uniform noise in "
                        "training, which dsmt does not reproduce. Fix: set router_jitter_noise to 0 in config.json")
    return problems
