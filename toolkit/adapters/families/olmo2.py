"""OLMo-2 (HF `Olmo2ForCausalLM`): the Llama weights with the norms moved. There is no pre-norm: each layer is

    h = x + post_attention_layernorm(attention(x));   out = h + post_feedforward_layernorm(mlp(h))

and q / k are RMS-normalised over the whole projection (q_norm over num_heads x head_dim, k_norm over
num_kv_heads x head_dim), before RoPE, rather than per head (Qwen3's). megatron-core's layer has neither, so the
layer spec (`edit_olmo2_layer_spec`) swaps submodules of megatron's own layer:

    megatron TransformerLayer slot      here
    input_layernorm, pre_mlp_layernorm  IdentityOp (TE: linear_qkv / linear_fc1 without their fused norm)
    self_attn_bda, mlp_bda              norm of the sublayer output, then megatron's bias-dropout-add
    q_layernorm, k_layernorm            `ProjectionRMSNorm`: each TP rank holds its heads' slice of the weight;
                                        the sum of squares is all-reduced over the TP group (exact at any TP)

The norms compute in fp32 and multiply by the weight before casting back, as HF's Olmo2RMSNorm does."""

from __future__ import annotations

import dataclasses

import torch

from toolkit.adapters.config_checks import attention_dropout_problems
from toolkit.adapters.family import AdapterError, Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS, check_llama_config
from toolkit.adapters.post_norms import NormThenAdd, fp32_rms_norm
from toolkit.adapters.transforms import Kind

M = WeightMapping
L = "model.layers.*."
D = "decoder.layers.*."

OLMO2_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("model.embed_tokens.weight",)),
    M(D + "self_attention.linear_qkv.weight", Kind.QKV,
      (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight")),
    # Each TP rank holds its own query heads / KV heads: the whole-projection norms split like the projections.
    M(D + "self_attention.q_layernorm.weight", Kind.COLUMN, (L + "self_attn.q_norm.weight",)),
    M(D + "self_attention.k_layernorm.weight", Kind.COLUMN, (L + "self_attn.k_norm.weight",)),
    M(D + "self_attention.linear_proj.weight", Kind.ROW, (L + "self_attn.o_proj.weight",)),
    M(D + "self_attn_bda.norm.weight", Kind.REPLICATED, (L + "post_attention_layernorm.weight",)),
    M(D + "mlp.linear_fc1.weight", Kind.GATE_UP, (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight")),
    M(D + "mlp.linear_fc2.weight", Kind.ROW, (L + "mlp.down_proj.weight",)),
    M(D + "mlp_bda.norm.weight", Kind.REPLICATED, (L + "post_feedforward_layernorm.weight",)),
    M("decoder.final_layernorm.weight", Kind.REPLICATED, ("model.norm.weight",)),
)


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over a whole q (or k) projection, for megatron's q_layernorm / k_layernorm slot, which gets this
    rank's heads [..., heads_local, head_dim]. The weight is this rank's heads' slice ([heads_local x head_dim],
    column-parallel); the mean of squares spans all heads: the local sum is all-reduced over the TP group
    (autograd-aware: the backward all-reduces the gradient, each rank's x feeding every rank's output)."""

    heads_field = "num_attention_heads"

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        heads, tp_size = getattr(config, self.heads_field), config.tensor_model_parallel_size
        if heads % tp_size:
            raise AdapterError(f"olmo2: tp={tp_size} does not divide {self.heads_field}={heads}; its whole-projection "
                               f"q / k norms need whole heads on every TP rank: use a tp that divides {heads}")
        self.width, self.eps, self.tp_size = heads * hidden_size, eps, tp_size
        self.weight = torch.nn.Parameter(torch.ones(heads // tp_size * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.parallel_mode = "column"  # build.mark_tensor_parallel_weights
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None

    def _all_reduce(self, squares: torch.Tensor) -> torch.Tensor:
        import torch.distributed.nn.functional as dist_nn

        return dist_nn.all_reduce(squares, group=self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1)
        out = fp32_rms_norm(flat, weight=self.weight, eps=self.eps, width=self.width,
                            sum_of_squares=self._all_reduce if self.tp_size > 1 else None)
        return out.reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The weight keyed as split on dim 0 over TP (a plain module's default would key it replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets)


class KeyProjectionRMSNorm(ProjectionRMSNorm):
    heads_field = "num_query_groups"


def edit_olmo2_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """megatron's layer spec (local or TE) with OLMo-2's norms (see the module doc)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention, mlp = spec.submodules.self_attention, spec.submodules.mlp
    attention_parts = dict(q_layernorm=ProjectionRMSNorm, k_layernorm=KeyProjectionRMSNorm)
    mlp_parts = {}
    if transformer_engine:  # TE fuses the pre-norm into linear_qkv / linear_fc1: the plain TE linear instead
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        attention_parts["linear_qkv"] = TEColumnParallelLinear
        mlp_parts["linear_fc1"] = TEColumnParallelLinear
    norm_then_add = ModuleSpec(module=NormThenAdd, params={"config": config})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp,
        self_attention=dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, **attention_parts)),
        mlp=dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **mlp_parts)),
        self_attn_bda=norm_then_add, mlp_bda=norm_then_add, sharded_state_dict_keys_map={}))


def check_olmo2_config(hf_config) -> list[str]:
    problems = [p.replace("llama adapter", "olmo2 adapter (released OLMo-2 sets it false)")
                for p in check_llama_config(hf_config)]
    return problems + attention_dropout_problems(hf_config, family="olmo2", released="OLMo-2 releases set 0.0")


OLMO2 = register(ModelFamily(
    model_type="olmo2", hf_architecture="Olmo2ForCausalLM", weights=OLMO2_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qk_norm=True, qk_norm_spans_heads=True), check_config=check_olmo2_config,
    edit_layer_spec=edit_olmo2_layer_spec,
))
