"""Which of megatron-core's fused kernels a model is built with: on wherever the machine has them, off on the CPU;
`training.fusions: off` turns off the ones megatron compiles (TE's fused RoPE, a prebuilt kernel, stays).

Decided when the model is built (`toolkit.adapters.build.transformer_config`), from training.fusions, the device,
the kind of layers (Transformer Engine's or megatron's local ones) and what is importable; `dsmt train --dry-run`
names the choice for the spec's device. Each fusion computes what the unfused path computes (the same formula in
one kernel), so verify and training stay exact to their tolerances:

  bias_activation_fusion  megatron's jit-fused SwiGLU / GeGLU / GeLU(+bias) (`fusions/fused_bias_swiglu.py`,
                          `fused_bias_geglu.py`, `fused_bias_gelu.py`); torch.compile / jit on CUDA, no extra
                          package. megatron's own rule: silu gated, or gelu gated or with a bias.
  bias_dropout_fusion     the jit-fused bias + dropout + residual add of every layer.
                          Both are `megatron.core.jit.jit_fuser` functions: torch.compile on torch >= 2.2, so each
                          GPU rank compiles them (Inductor, Triton: a C compiler and libcuda) at the first step;
                          `dsmt preflight` compiles one such function on every node first.
  apply_rope_fusion       Transformer Engine's fused RoPE, for the BSHD and the packed THD layouts (without it,
                          megatron's THD RoPE syncs the host and loops over the records in every layer). Only with
                          TE's layers: dsmt's local layers rotate packed records by per-token frequencies
                          (toolkit/adapters/packed.py), which TE's BSHD kernel does not take.

Never on: masked_softmax_fusion (megatron's fused causal softmax kernel ignores an explicit mask, which packed
records need, and the sliding window: megatron-core 0.16.1 `FusedScaleMaskSoftmax.forward_fused_softmax`),
gradient_accumulation_fusion (it writes megatron-DDP's `main_grad`; DeepSpeed owns the gradients) and
persist_layer_norm (apex's persistent LayerNorm; TE's layers have their own)."""

from __future__ import annotations

from toolkit.adapters.longrope import unfused_rope_fields

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion")
COMPILED = ("bias_activation_fusion", "bias_dropout_fusion")  # megatron's jit_fuser (torch.compile); RoPE is TE's
NEVER = ("masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm")  # see the docstring


def fused_rope_available() -> bool:
    """Transformer Engine's fused RoPE as megatron-core imports it (None when TE lacks it)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None or rope_utils.fused_apply_rotary_pos_emb_thd is not None


def fusion_fields(*, settings, device: str, te_layers: bool, fused_rope: bool | None = None,
                  fusions: str = "auto") -> dict[str, bool]:
    """TransformerConfig fusion flags for a model of `settings` built on `device` ("cuda" / "cpu") with Transformer
    Engine's layers (`te_layers`) or the local ones; `fusions` is training.fusions ("off": none of the COMPILED
    ones; TE's fused RoPE is a prebuilt CUDA kernel, and without it packed THD records would take megatron's
    unfused RoPE, which reads the record lengths back to the host in every layer). Encoders (BERT)
    keep their own post-LN layers unfused. `fused_rope`: whether TE's fused RoPE exists (None: ask megatron-core)."""
    fields = dict.fromkeys(FUSIONS, False)
    if device != "cuda" or settings.encoder is not None:
        return fields
    architecture = settings.family.architecture
    # A clamped GLU (GPT-OSS) stays unfused: megatron-core 0.16's fused quick-GEGLU clamps fc1's output before it adds
    # the bias (fused_bias_geglu.weighted_bias_quick_geglu_impl); the unfused MLP clamps the biased value, as HF.
    clamped = settings.transformer_fields.get("activation_func_clamp_value") is not None
    fields["bias_activation_fusion"] = not clamped and (
        (architecture.activation == "silu" and architecture.gated_mlp)
        or (architecture.activation == "gelu" and (architecture.gated_mlp or architecture.linear_bias)))
    fields["bias_dropout_fusion"] = True
    if fusions == "off":
        fields.update(dict.fromkeys(COMPILED, False))
    # Multi-latent attention (DeepSeek) rotates inside its own module: megatron refuses the fused RoPE there without
    # YaRN and with it switches to its triton MLA kernels, never run here; MLA keeps the unfused RoPE.
    mla = bool(settings.transformer_fields.get("multi_latent_attention"))
    # Interleaved RoPE (ERNIE 4.5): megatron-core 0.16 drops `rotary_interleaved` on the fused packed (THD) path
    # (rope_utils.apply_rotary_pos_emb), and the fused unpacked one needs TE >= 2.3; the unfused RoPE takes it.
    interleaved = bool(settings.transformer_fields.get("rotary_interleaved"))
    fields["apply_rope_fusion"] = (te_layers and architecture.position_embedding == "rope" and not mla and not interleaved
                                   and (fused_rope_available() if fused_rope is None else fused_rope))
    # Phi-4-mini's long-RoPE factor on cos / sin: TE's fused RoPE takes no mscale (toolkit/adapters/longrope.py)
    return fields | unfused_rope_fields(settings.rope_scaling)


def run_megatron_eagerly() -> None:
    """training.fusions: off: make the rank compile nothing. megatron-core also wraps small helpers that no
    TransformerConfig flag turns off in `jit_fuser` (DeepSeek-V3's router expert bias, Qwen3-Next's output gate,
    ...), bound to torch.compile when megatron's modules are imported; only dynamo's global switch makes them run
    eagerly (what the CPU backend does: toolkit/backend/cpu.py). It holds for the whole process, torch.compile
    calls of an `api.initialize` script included."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def describe(fields: dict[str, bool], *, fusions: str = "auto") -> str:
    """One line for the dry run: which fusions are on and which off, why when training.fusions turned them off, and
    which of those on compile at the first step."""
    def short(name: str) -> str:
        return name.removesuffix("_fusion").removeprefix("apply_")

    on = [short(name) for name in FUSIONS if fields[name]]
    off = [short(name) for name in FUSIONS if not fields[name]]
    line = f"fused kernels on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"
    compiled = [short(name) for name in COMPILED if fields[name]]
    if fusions == "off":
        return line + (" (training.fusions: off turned off the ones megatron compiles: nothing compiles"
                       + ("; TE's fused RoPE is a prebuilt kernel and stays" if fields["apply_rope_fusion"] else "")
                       + ")")
    if compiled:
        return line + (f" ({', '.join(compiled)}: megatron compiles them with torch.compile at the first step on each "
                       "GPU rank, which needs a C compiler and libcuda there: `dsmt preflight` checks; "
                       "training.fusions: off runs them unfused)")
    return line
