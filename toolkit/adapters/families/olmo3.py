"""OLMo-3 (HF `Olmo3ForCausalLM`): OLMo-2's layer (olmo2.py: no pre-norm, post-attention / post-feedforward norms,
q / k RMSNorms over the whole projection) with two kinds of layers named by `layer_types`:

* `sliding_attention` layers see a window of `sliding_window` tokens (megatron's window_size / window_attn_skip_freq,
  toolkit/adapters/window.py), `full_attention` layers the whole sequence (3 windowed, then 1 full, in the releases);
* each kind has its own RoPE (`rope_parameters.sliding_attention` / `.full_attention`). In the released 7B / 32B
  the full layers carry YaRN from the long-context stage (factor 8, attention_factor 1.2079...) and the sliding
  layers plain RoPE at the same rope_theta.

What HF computes per kind (`Olmo3RotaryEmbedding`): inverse frequencies from transformers' rope functions, and cos
and sin multiplied by the kind's attention factor. Here:

* the inverse frequencies of each kind are read from transformers' own `Olmo3RotaryEmbedding` (`read_olmo3_quirks`),
  so YaRN (with its correction range), linear and llama3 scaling are HF's numbers rather than a re-derivation
  (megatron-core's YaRN derives its factor from mscale and cannot take OLMo-3's explicit attention_factor); the
  model's rotary module becomes gemma3.py's `DualRotary` (full, then sliding) with these frequencies, and each
  layer's attention keeps its kind's table (gemma3.py's per-layer RoPE attention);
* the attention factor a: RoPE rotates the whole head (partial rotary is refused), so cos and sin scaled by a scale
  each score by a^2. The layers of a kind with a != 1 are built with megatron's `softmax_scale` = a^2 / sqrt(head_dim)
  (a copy of the config for that layer: local and Transformer Engine attention both read it at construction).

Only static RoPE kinds (default, linear, llama3, yarn) have fixed frequencies; `dynamic` / `longrope` (chosen per
forward) and others are refused by name. In bf16 HF rotates q / k in fp32 (cos / sin kept fp32) and megatron in the
activations' dtype, as for OLMo-2: fp32 logits match, bf16 ones within bf16 rounding."""

from __future__ import annotations

import copy
import math
import dataclasses
import functools

import torch

from toolkit.adapters.config_checks import attention_dropout_problems, layer_type_problems, static_rope_problems
from toolkit.adapters.family import AdapterError, ModelFamily, register
from toolkit.adapters.families.gemma3 import DualRotary, per_layer_rope_attention_class
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.olmo2 import OLMO2, OLMO2_WEIGHTS, edit_olmo2_layer_spec
from toolkit.adapters.window import FULL, SLIDING, window_fields



@dataclasses.dataclass(frozen=True)
class LayerRopes:
    """HF's RoPE of each layer kind: inverse frequencies and the factor on cos / sin; which layers are sliding."""

    inv_freq: dict  # layer kind -> tuple of fp32 values (head_dim / 2)
    attention_factor: dict  # layer kind -> float
    sliding_layers: tuple[bool, ...]

    def softmax_scales(self, *, head_dim: int) -> tuple[float | None, ...]:
        """Per layer: megatron's softmax_scale for the layer's attention factor (None: megatron's 1 / sqrt(d))."""
        factors = (self.attention_factor[SLIDING if sliding else FULL] for sliding in self.sliding_layers)
        return tuple(None if a == 1.0 else a**2 * head_dim**-0.5 for a in factors)


def rope_of_kind(hf_config, kind: str) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return params.get(kind, params) or {}


def rope_problems(hf_config) -> list[str]:
    return [problem for kind in sorted(set(hf_config.layer_types) & {SLIDING, FULL})
            for problem in static_rope_problems(rope_of_kind(hf_config, kind), family="olmo3",
                                                field=f"rope_parameters.{kind}",
                                                released="released OLMo-3: default on sliding layers, yarn on full ones")]


def check_olmo3_config(hf_config) -> list[str]:
    problems = []
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (biases on q/k/v/o) is not supported by the olmo3 adapter (released "
                        "OLMo-3 sets it false)")
    problems += attention_dropout_problems(hf_config, family="olmo3", released="OLMo-3 releases set 0.0")
    problems += layer_type_problems(hf_config, family="olmo3")
    if not getattr(hf_config, "sliding_window", None):
        problems.append(f"sliding_window={hf_config.sliding_window}: transformers' Olmo3Model builds a "
                        "sliding-window mask on every forward and fails without one; set it (released: 4096)")
    return problems + rope_problems(hf_config)


def read_olmo3_quirks(hf_config) -> dict:
    """HF's own per-kind RoPE (`Olmo3RotaryEmbedding` holds `<kind>_inv_freq` and `<kind>_attention_scaling` for
    the kinds the model has; a kind it lacks takes the other's) and the per-layer softmax scales."""
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

    hf_rotary = Olmo3RotaryEmbedding(hf_config)
    kinds = hf_rotary.layer_types  # the kinds present, sorted
    inv_freq = {kind: tuple(getattr(hf_rotary, f"{kind}_inv_freq").float().tolist()) for kind in kinds}
    factors = {kind: float(getattr(hf_rotary, f"{kind}_attention_scaling")) for kind in kinds}
    for kind, other in ((SLIDING, FULL), (FULL, SLIDING)):
        inv_freq.setdefault(kind, inv_freq[other])
        factors.setdefault(kind, factors[other])
    ropes = LayerRopes(inv_freq=inv_freq, attention_factor=factors,
                       sliding_layers=tuple(kind == SLIDING for kind in hf_config.layer_types))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return {"layer_ropes": ropes, "softmax_scales": ropes.softmax_scales(head_dim=head_dim)}


@functools.cache
def per_layer_scale_attention_class():
    """gemma3.py's per-layer RoPE attention, built with its layer's softmax scale (the kind's attention factor)."""
    base = per_layer_rope_attention_class()

    class PerLayerScaleSelfAttention(base):
        def __init__(self, *args, config, layer_number: int, softmax_scales: tuple[float | None, ...], **kwargs):
            scale = softmax_scales[layer_number - 1]  # layer_number: global, from 1
            if scale is not None:  # megatron's attention and its core attention read config.softmax_scale
                config = copy.copy(config)
                config.softmax_scale = scale
            super().__init__(*args, config=config, layer_number=layer_number, **kwargs)

    return PerLayerScaleSelfAttention


def edit_olmo3_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """OLMo-2's norms (olmo2.py), and an attention that takes its layer kind's RoPE table and scale."""
    spec = edit_olmo2_layer_spec(spec, config=config, settings=settings, transformer_engine=transformer_engine)
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, module=per_layer_scale_attention_class(), params={
        **attention.params, "local_rope_layers": settings.quirks["layer_ropes"].sliding_layers,
        "softmax_scales": settings.quirks["softmax_scales"]})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def edit_olmo3_model(model, *, settings) -> None:
    """The model's rotary module with HF's frequencies per kind: gemma3.py's DualRotary (full, then sliding)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    ropes = settings.quirks["layer_ropes"]
    full_rotary = model.rotary_pos_emb
    sliding_rotary = RotaryEmbedding(kv_channels=model.config.kv_channels, rotary_percent=1.0,
                                     use_cpu_initialization=True, cp_group=full_rotary.cp_group)
    for rotary, kind in ((full_rotary, FULL), (sliding_rotary, SLIDING)):
        rotary.inv_freq = torch.tensor(ropes.inv_freq[kind], dtype=torch.float32, device=full_rotary.inv_freq.device)
    model.rotary_pos_emb = DualRotary(global_rotary=full_rotary, local_rotary=sliding_rotary)
    check_layer_scales(model, scales=settings.quirks["softmax_scales"])


def check_layer_scales(model, *, scales: tuple[float | None, ...]) -> None:
    """Each layer whose kind scales its scores (YaRN's attention factor) must hold that scale in its core attention:
    megatron's local attention and Transformer Engine's (>= 1.10; older TE drops megatron's softmax_scale) both keep
    it as `softmax_scale`. Refused by name otherwise, before any forward."""
    for name, module in model.named_modules():
        if not name.endswith("self_attention") or scales[module.layer_number - 1] is None:
            continue
        expected, got = scales[module.layer_number - 1], getattr(module.core_attention, "softmax_scale", None)
        if got is None or not math.isclose(got, expected, rel_tol=1e-12):
            raise AdapterError(f"olmo3: {name}.core_attention ({type(module.core_attention).__name__}) scales scores "
                               f"by {got}, not the {expected} its layer's RoPE attention factor needs (Transformer "
                               "Engine < 1.10 ignores megatron's softmax_scale); upgrade Transformer Engine, or set "
                               "training.attention: local")


OLMO3 = register(ModelFamily(
    model_type="olmo3", hf_architecture="Olmo3ForCausalLM", weights=OLMO2_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=OLMO2.architecture, read_config=window_fields,
    check_config=check_olmo3_config, read_quirks=read_olmo3_quirks, edit_layer_spec=edit_olmo3_layer_spec,
    edit_model=edit_olmo3_model,
))
