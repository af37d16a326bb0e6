"""Tiny random HF checkpoints shared by the adapter tests (built once per session, saved with save_pretrained)."""

import pytest

from toolkit.models.tiny import make_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Per-frequency factors (head_dim 8: 4 each) far from 1, so a short / long mix-up or a missing one shows in logits.
PHI3_LONGROPE = dict(original_max_position_embeddings=16, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.7, 3.1, 6.4],
    "long_factor": [2.3, 4.1, 9.7, 17.5]})

# Phi-4-mini's shape on the tiny model: 6 of head_dim 8 dims rotate (factor 0.75, 3 long-RoPE factors each), tied
# embeddings, original length 16 so verify's 32 positions take the long factors.
PHI4_MINI_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.7, 3.1],
                  "long_factor": [2.3, 4.1, 9.7], "partial_rotary_factor": 0.75}
PHI4_MINI = dict(partial_rotary_factor=0.75, original_max_position_embeddings=16, rope_parameters=PHI4_MINI_ROPE,
                 tie_word_embeddings=True)

# Moonlight-16B-A3B's shape on the tiny DeepSeek-V3: a plain q projection (q_lora_rank null), rms_norm_eps 1e-5 (HF's
# latent norms keep 1e-6), one expert group, 2 shared experts, its routed scaling, plain RoPE, no MTP layer.
MOONLIGHT = dict(q_lora_rank=None, rms_norm_eps=1e-5, n_group=1, topk_group=1, n_shared_experts=2,
                 routed_scaling_factor=2.446, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                 num_nextn_predict_layers=0)

VARIANTS = {
    "llama": dict(model_type="llama"),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3_rope": dict(model_type="llama", rope_parameters=LLAMA3_ROPE, seed=3),
    "qwen2": dict(model_type="qwen2", seed=1),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True, seed=4),
    "mistral": dict(model_type="mistral", seed=2),
    "qwen3": dict(model_type="qwen3", seed=5),            # q/k head norms, head_dim 16 != 64 / 8
    "qwen3_tied": dict(model_type="qwen3", tie_word_embeddings=True, seed=6),
    "gemma": dict(model_type="gemma", seed=7),            # GeGLU, (1 + w) norms, sqrt(h) embedding scale, 1 KV head
    "phi3": dict(model_type="phi3", seed=8),              # packed qkv_proj and gate_up_proj
    "gpt2": dict(model_type="gpt2", seed=9),              # learned positions, LayerNorm + biases, Conv1D, GELU
    # sliding windows of 8 tokens, shorter than verify's 32: every layer (Mistral v0.1, Phi-3-mini-4k), or only the
    # layers from max_window_layers on (Qwen2: layers 2 and 3, across the PP2 boundary)
    "mistral_window": dict(model_type="mistral", sliding_window=8, seed=12),
    "phi3_window": dict(model_type="phi3", sliding_window=8, seed=13),
    "qwen2_window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2, seed=14),
    # Phi-3 long-RoPE: original length 16, so verify's 32 positions take the long factors (test_longrope.py: short)
    "phi3_longrope": dict(model_type="phi3", seed=10, **PHI3_LONGROPE),
    "granite": dict(model_type="granite", seed=10),      # embedding / residual / attention / logits multipliers
    "starcoder2": dict(model_type="starcoder2", seed=11),  # LayerNorm + biases, GELU MLP, window 8 < seq 32
    "olmo2": dict(model_type="olmo2", seed=12),          # post-norms, q/k norms over the whole projection
    # pre- and post-norms, softcapped scores and logits, query_pre_attn_scalar, local (window 8) / global layers
    "gemma2": dict(model_type="gemma2", seed=15),
    # Gemma 2's layer plus q / k head norms, local layers with their own RoPE base, linear scaling on global ones
    "gemma3": dict(model_type="gemma3_text", seed=16),
    # The checkpoints of 2026 (toolkit/models/tiny.py says what each tiny model exercises): q / k / v biases without
    # an output bias (Seed-OSS); NoPE layers, one per PP2 stage (SmolLM3); interleaved-pair RoPE in fp32 (ERNIE 4.5);
    # OLMo-2's norms with windows and a RoPE per layer type, YaRN with an attention factor on the full layers
    # (OLMo-3); post-norms, per-head q / k norms, windowed RoPE layers and NoPE full layers (EXAONE 4)
    "seed_oss": dict(model_type="seed_oss", seed=17),
    "smollm3": dict(model_type="smollm3", seed=18),
    "ernie4_5": dict(model_type="ernie4_5", seed=19),
    "olmo3": dict(model_type="olmo3", seed=20),
    "exaone4": dict(model_type="exaone4", seed=21),
    "phi4_mini": dict(model_type="phi3", seed=22, **PHI4_MINI),  # partial rotary (0.75) with long-RoPE, tied
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-hf")
    return {name: make_tiny_checkpoint(root / name, **kwargs) for name, kwargs in VARIANTS.items()}
