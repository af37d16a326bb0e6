"""megatron.json: the megatron-core settings the layout determines.

Three groups, each checked in tests against megatron-core itself:
  transformer_config -> `TransformerConfig` / `ModelParallelConfig` dataclass fields (dtypes as torch dtype names),
  schedule           -> keyword arguments of the function `get_forward_backward_func()` returns,
  layout             -> derived numbers for the training loop and the summary (not megatron arguments).
Model-family details (normalization, activation, RoPE) are the adapters' business; only the shape is written here.
"""

from __future__ import annotations

from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import RunLayout, padded_vocab_size, spec_attention
from toolkit.spec.schema import JobSpec

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # torch.<name>


def build_megatron_settings(*, spec: JobSpec, layout: RunLayout, shape: ModelShape) -> dict:
    return {
        "transformer_config": _transformer_config(spec=spec, layout=layout, shape=shape),
        "schedule": {
            "num_microbatches": layout.grad_accum_steps,
            "micro_batch_size": layout.micro_batch_size,
            "seq_length": layout.seq_length,
        },
        "layout": {
            "world_size": layout.world_size,
            "data_parallel_size": layout.dp,
            **({"expert_data_parallel_size": layout.expert_dp} if shape.is_moe else {}),
            # fused: Transformer Engine's attention (flash / cuDNN, needed by cp > 1); local: megatron's unfused one
            "attention": spec_attention(spec),
            "global_batch_size": layout.global_batch_size,
            "tokens_per_step": layout.tokens_per_step,
            "vocab_size": shape.vocab_size,
            "padded_vocab_size": padded_vocab_size(vocab_size=shape.vocab_size, divisible_by=spec.model.make_vocab_size_divisible_by),
            "tied_embeddings": shape.tied_embeddings,
            "seed": spec.training.seed,
        },
    }


def _transformer_config(*, spec: JobSpec, layout: RunLayout, shape: ModelShape) -> dict:
    precision = spec.training.precision
    interleaved = layout.vpp > 1
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp if interleaved else None,
        "sequence_parallel": layout.sp,
        "context_parallel_size": layout.cp,
        "bf16": precision == "bf16",
        "fp16": precision == "fp16",
        "params_dtype": _DTYPES[precision],
        "pipeline_dtype": _DTYPES[precision],
        "overlap_p2p_comm": interleaved and spec.communication.overlap_p2p_comm,
        "batch_p2p_comm": not (interleaved and spec.communication.overlap_p2p_comm),
        "batch_p2p_sync": spec.cluster.device == "cuda",  # a CUDA synchronize; off on CPU
        "variable_seq_lengths": False,
        **_recompute(spec=spec, layout=layout),
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_kv_heads,
        # an all-MoE model's MLPs are its experts; with dense layers mixed in (DeepSeek) those are the dense width
        "ffn_hidden_size": shape.moe_ffn_hidden_size if shape.is_moe and not shape.dense_layers else shape.ffn_hidden_size,
        "kv_channels": shape.mla.v_head_dim if shape.mla else shape.kv_channels,
        "gated_linear_unit": shape.gated_mlp,
        "use_cpu_initialization": spec.cluster.device == "cpu",
        **_experts(layout=layout, shape=shape),
        **_mla(shape=shape),
    }


def _mla(*, shape: ModelShape) -> dict:
    """Multi-latent attention's widths (megatron's `MLATransformerConfig`; DeepSeek); its RoPE settings come from the
    checkpoint's config (toolkit/adapters/mla.py)."""
    if shape.mla is None:
        return {}
    m = shape.mla
    return {"multi_latent_attention": True, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
            "qk_head_dim": m.qk_nope_head_dim, "qk_pos_emb_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}


def _experts(*, layout: RunLayout, shape: ModelShape) -> dict:
    """A mixture-of-experts model's layers (dense models write none of these): every MLP num_experts experts,
    num_experts / ep of them on each rank, one megatron MLP each (grouped GEMM needs CUDA kernels the CPU lacks and
    the adapters do not use), tokens exchanged by all-to-all. The routing (softmax before or after top-k) and the
    load-balancing coefficient come from the checkpoint's config (toolkit/adapters/families/moe.py)."""
    if not shape.is_moe:
        return {}
    shared = {"moe_shared_expert_intermediate_size": shape.shared_expert_ffn_hidden_size,
              "moe_shared_expert_gate": shape.shared_expert_gate} if shape.shared_expert_ffn_hidden_size else {}
    # the dense layers mixed in (DeepSeek's first_k_dense_replace, Qwen2-MoE's mlp_only_layers): 1 = MoE layer
    pattern = {"moe_layer_freq": [int(shape.is_moe_layer(i)) for i in range(shape.num_layers)]} \
        if shape.dense_layers else {}
    return {"expert_model_parallel_size": layout.ep, "num_moe_experts": shape.num_experts,
            "moe_router_topk": shape.moe_topk, "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
            "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall",
            # megatron's default has biases, which its experts refuse under TP; GPT-OSS's layers have them (dsmt adds
            # each expert's fc2 bias once per expert-TP group: toolkit/adapters/families/gpt_oss.py)
            "add_bias_linear": shape.expert_bias,
            **shared, **pattern}


def _recompute(*, spec: JobSpec, layout: RunLayout) -> dict:
    mode = spec.training.recompute
    if mode == "none":
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if mode == "selective":  # core attention only (Korthikanti et al. 2022)
        return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
