"""Tiny random HF checkpoints built from a config and saved with `save_pretrained` (demo, tests, benchmarks).
Nothing is downloaded: the weights are random, norm weights included (so a wrong norm mapping shows in logits)."""

from __future__ import annotations

from pathlib import Path

import torch

# Small but with every feature that breaks converters: GQA (4 query heads per KV head), a vocabulary that no TP
# divides evenly (250 -> padded to 256), several layers for PP.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=250, max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)

# What each family's tiny model changes from TINY_LLAMA, so that its own features show in the logits: a head_dim
# that is not hidden / heads (Qwen3, Gemma), one KV head (Gemma: TP 2 and 4 replicate it), special-token ids inside
# the tiny vocabulary (Phi-3's and GPT-2's defaults are past it), and no dropout (parity needs none).
_TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_FAMILY_FIELDS = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "gemma": dict(head_dim=16, num_key_value_heads=1, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "phi3": dict(sliding_window=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **_TOKEN_IDS),
    # 4 experts, top-2: Mixtral renormalises the top-k weights, this Qwen3-MoE does not (norm_topk_prob false),
    # so both of megatron's router modes are exercised.
    "mixtral": dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    # DeepSeek-V2-Lite's shape (rms_norm_eps 1e-6, the latent norms' fixed eps in HF, as in every DeepSeek release): plain q projection, YaRN RoPE with mscale (so the softmax scale moves), one dense
    # first layer, 4 routed experts top-2 plus 2 shared ones, softmax routing without renormalisation.
    "deepseek_v2": dict(rms_norm_eps=1e-6, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4, n_shared_experts=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, num_experts_per_tok=2, topk_method="greedy",
                        routed_scaling_factor=1.0, norm_topk_prob=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 32, "mscale": 0.707,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V3's shape: low-rank q, sigmoid routing over a score-correction bias inside 2 groups of 2 experts
    # (1 chosen), renormalised and scaled by 2.5, one dense first layer, one multi-token-prediction layer.
    "deepseek_v3": dict(rms_norm_eps=1e-6, num_key_value_heads=8, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, num_experts_per_tok=2, n_group=2,
                        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1),
    # Qwen1.5-MoE's shape: q / k / v biases, 4 experts top-2 plus a gated shared expert, layer 1 dense.
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], use_sliding_window=False),
    # Granite's four scalars away from 1 (attention_multiplier is not 1/sqrt(head_dim) = 0.125), so each shows.
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5,
                    attention_dropout=0.0),
    # A window of 8 tokens, shorter than verify's 32-token sequences; biases randomised (make_tiny_checkpoint).
    "starcoder2": dict(sliding_window=8, norm_epsilon=1e-5, use_bias=True, hidden_act="gelu_pytorch_tanh",
                       residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=True,
                       **_TOKEN_IDS),
    # 4 KV heads (TP 4 keeps whole KV heads per rank, which the whole-projection q / k norms need).
    "olmo2": dict(num_key_value_heads=4, attention_dropout=0.0, **_TOKEN_IDS),
    # Gemma 2: softcaps small enough to bend these small logits and scores, a query_pre_attn_scalar that is not
    # head_dim, a window of 8 on the even (local) layers, 2 KV heads.
    "gemma2": dict(head_dim=16, num_key_value_heads=2, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                   sliding_window=8, attn_logit_softcapping=0.5, final_logit_softcapping=3.0, attention_dropout=0.0,
                   tie_word_embeddings=True, **_TOKEN_IDS),
    # Gemma 3 text: local layers 0 and 2 (pattern 2) with their own RoPE base, the global ones with linear scaling.
    "gemma3_text": dict(head_dim=16, num_key_value_heads=2, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2, attention_dropout=0.0,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}},
                        tie_word_embeddings=True, **_TOKEN_IDS),
    # GLM-4.5's shape: grouped-query attention with q / k / v biases and per-head q / k norms, head_dim 16 (not
    # hidden / heads) with RoPE on the first half of each head, DeepSeek-V3's routing (sigmoid over a correction
    # bias inside 2 groups of 2 experts, 1 chosen, renormalised, x 2.5), a shared expert, one dense first layer,
    # one multi-token-prediction layer (carried, not built by HF).
    "glm4_moe": dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=4,
                     n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, num_experts_per_tok=2,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     num_nextn_predict_layers=1),
    # Seed-OSS: q / k / v biases without an o_proj bias, head_dim 16 (not hidden / heads), untied as released; its
    # config class defaults both dropouts to 0.1: parity needs them off.
    "seed_oss": dict(head_dim=16, attention_dropout=0.0, residual_dropout=0.0),
    # SmolLM3: NoPE on layers 1 and 2, so each PP2 stage has one and a stage that numbered its layers from 0 would
    # pick the wrong ones; tied embeddings as released; its special-token defaults are past the tiny vocabulary.
    "smollm3": dict(no_rope_layers=[1, 0, 0, 1], tie_word_embeddings=True, **_TOKEN_IDS),
    # ERNIE 4.5 (0.3B's layout): interleaved-pair RoPE, head_dim 16 (not hidden / heads), tied embeddings.
    "ernie4_5": dict(head_dim=16, tie_word_embeddings=True, **_TOKEN_IDS),
    # OLMo-3: windowed layers 0 and 3, full ones 1 and 2 (each PP2 stage has both, in a different order, so a stage
    # that numbered its layers from 0 would pick the wrong ones), a window of 8; the full layers with YaRN and an
    # explicit attention factor as released, the sliding ones plain RoPE at another base (a swap shows); 4 KV heads
    # (TP 4 keeps whole KV heads per rank, which the whole-projection q / k norms need).
    "olmo3": dict(num_key_value_heads=4, attention_dropout=0.0, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                   "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 32, "attention_factor": 1.2,
                                                      "beta_fast": 32, "beta_slow": 1}},
                  **_TOKEN_IDS),
    # EXAONE 4.0: windowed layers 0 and 3 with RoPE, full ones 1 and 2 without (NoPE; each PP2 stage has both, in a
    # different order), a window of 8; head_dim 16 (not hidden / heads); llama3-scaled RoPE as released (so
    # max_position_embeddings is past its original 8192); tied embeddings as EXAONE-4.0-1.2B.
    "exaone4": dict(head_dim=16, sliding_window=8, attention_dropout=0.0, max_position_embeddings=65536,
                    layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                    tie_word_embeddings=True),
    # GPT-OSS: windowed layers 0 and 2 (window 8, shorter than verify's 32 tokens), 4 experts top-2 of width 48,
    # a swiglu_limit that clamps some of these small activations, YaRN past its original 16 positions with a
    # rope_theta whose correction range is not whole (so truncate false shows); sinks and the stacked expert biases
    # randomised (make_tiny_checkpoint).
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=8,
                    max_position_embeddings=64, swiglu_limit=0.3, attention_dropout=0.0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
                    **_TOKEN_IDS),
    # Llama 4 text: layers 1 and 3 MoE (4 experts, top-1, width 48, plus the shared expert), 0 and 2 dense (width
    # 96), so each PP2 stage has both; layer 2 NoPE with temperature tuning that moves within 32 tokens (floor_scale
    # 4) and no q / k norm, the others chunked (8 tokens, shorter than verify's 32) with the L2 q / k norm;
    # head_dim 16 (not hidden / heads), llama3-scaled RoPE as Scout (so max_position_embeddings is past its
    # original 8192).
    "llama4_text": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size=48,
                        intermediate_size_mlp=96, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1],
                        attention_chunk_size=8, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
                        attention_dropout=0.0, max_position_embeddings=65536,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192},
                        **_TOKEN_IDS),
    # Qwen3-Next: DeltaNet layers 0, 2, 3 and full attention on layer 1 (each PP2 stage then has a different mix,
    # so a stage numbering its layers from 0 builds the wrong kinds); 2 key heads serving 2 value heads each (HF's
    # per-key-head interleave of in_proj_qkvz / in_proj_ba shows at TP 2), key and value head dims that differ;
    # gated attention with RoPE on 4 of head_dim 16 (partial_rotary_factor 0.25, as released); 4 experts top-2
    # renormalised plus the gated shared expert, layer 2 dense. Zero-centred norms are randomised around 1 here.
    "qwen3_next": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[2], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=12, linear_conv_kernel_dim=4, attention_dropout=0.0,
                       layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                       **_TOKEN_IDS),
    "gpt2": dict(n_embd=64, n_inner=96, n_layer=4, n_head=8, n_positions=128, vocab_size=250, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2),
}


def tiny_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    if model_type not in _FAMILY_FIELDS:
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {', '.join(_FAMILY_FIELDS)}")
    base = {} if model_type == "gpt2" else dict(TINY_LLAMA)
    fields = {**base, **_FAMILY_FIELDS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **fields)


def make_tiny_checkpoint(path: Path, *, model_type: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                         max_shard_size: str | None = None, **overrides) -> Path:
    """Save a randomly initialised tiny model of `model_type` to `path` and return the path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:  # HF initialises norms to 1 (or 0): randomise them
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith((".bias", "_proj_bias")):  # GPT-OSS's stacked expert biases: *.gate_up_proj_bias
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("self_attn.sinks"):  # GPT-OSS's attention sinks (HF: normal(0, 0.02)): so they show
                param.copy_(torch.randn_like(param))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "feed_forward.router.weight")):
                param.copy_(0.5 * torch.randn_like(param))  # MoE router: decisive routing, no near-ties between experts
            elif name.endswith("linear_attn.dt_bias"):  # Qwen3-Next (HF: ones): per value head, so a head order shows
                param.copy_(0.5 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: away from 0, so it shows
                buffer.copy_(0.05 * torch.randn_like(buffer))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    _save_tiny_tokenizer(path, vocab_size=model.config.vocab_size)
    return Path(path)


def _save_tiny_tokenizer(path: Path, *, vocab_size: int) -> None:
    """A character-level tokenizer (letters, digits, space, punctuation) over `vocab_size` ids, saved in HF format
    (no download); the ids past the characters are unused filler tokens."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?'\"-:;\n")
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    extra = [f"w{i}" for i in range(vocab_size - len(vocab))]
    vocab.update({tok: len(specials) + len(words) + i for i, tok in enumerate(extra)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # characters back together, no spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def save_random_init(path: Path, *, config_fields: dict, seed: int) -> Path:
    """A randomly initialised HF model of an inline config (job specs with `model.config`), saved with
    save_pretrained, plus the tiny word tokenizer when the vocabulary is large enough for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config_fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if config.vocab_size >= 64:
        _save_tiny_tokenizer(path, vocab_size=config.vocab_size)
    return Path(path)
