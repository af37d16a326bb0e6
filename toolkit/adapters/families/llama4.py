"""Llama 4 text (HF `Llama4ForCausalLM`, the language model of Llama-4-Scout / Maverick): Llama's attention and norms
with an MoE decoder and three attention changes, each checked against transformers' modeling_llama4.py.

  MoE         layers `moe_layers` (default every `interleave_moe_layer_step`-th, from step - 1) are MoE, the others a
              dense SwiGLU MLP of `intermediate_size_mlp` (megatron's `moe_layer_freq` list, `ffn_hidden_size`).
              An MoE layer: router logits, top-1, sigmoid of the chosen logit (fp32, back to the activations'
              dtype) multiplied into the expert's INPUT; plus one shared SwiGLU expert of `intermediate_size` on
              every token. megatron-core: `moe_router_score_function="sigmoid"` (top-1 of sigmoid = top-1 of the
              logits; no renormalisation at k = 1), `moe_apply_probs_on_input` (which needs top-1: other
              `num_experts_per_tok` are refused), `moe_shared_expert_intermediate_size`. HF adds no
              load-balancing loss. The experts are stored stacked and [in, out]: `experts.gate_up_proj`
              [E, hidden, 2I] with gate the first I columns (`chunk(2)`), `experts.down_proj` [E, I, hidden]:
              `stacked_experts`, transposed, GATE_UP_PACKED / ROW rows.
  RoPE        the pair (x[2i], x[2i+1]) rotated as a complex number in fp32 (`torch.polar`): megatron's
              `rotary_interleaved` with ERNIE 4.5's fp32 rotation (ernie4_5.py); llama3 scaling as the shared
              translation reads it. NoPE layers (`no_rope_layers` entry 0): megatron's `no_rope_freq` inverted.
  q / k       on RoPE layers with `use_qk_norm`, a weightless RMSNorm (eps `rms_norm_eps`, fp32) of each head of q
              and k AFTER the rotation (megatron's qk norm slot is before it: same up to rounding, so it is done
              here in HF's order instead); on NoPE layers with `attn_temperature_tuning`, the query of position p
              times log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 (p the index in the sequence, as HF).
  chunks      `layer_types` "chunked_attention" layers attend causally within blocks of `attention_chunk_size`
              tokens (transformers' chunked mask: q // chunk == k // chunk): a block-diagonal causal mask given
              to megatron's local softmax, combined with any mask the batch brings (packed records).
  softmax     in fp32 (megatron's default): HF's default attention (sdpa) accumulates in fp32 too; only its eager
              path takes it in bf16.

The three attention changes are one forward pre-hook on each layer's core attention (`Llama4AttentionInputs`), so
every TP / PP / EP layout sees the layer's own global index. Transformer Engine's attention is refused: the chunked
mask and the per-position query scale are written for megatron's local attention (which verify and convert pick
by themselves: Architecture.local_layers_only)."""

from __future__ import annotations

import dataclasses

import torch

from toolkit.adapters.family import AdapterError, Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.ernie4_5 import edit_ernie4_5_layer_spec
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.moe import LLAMA_WITHOUT_MLP, shared_expert_rows
from toolkit.adapters.hf_config import rope_settings
from toolkit.adapters.packed import record_positions_from_mask
from toolkit.adapters.transforms import Kind
from toolkit.models.mixer_shapes import LLAMA4_LOCAL

M = WeightMapping
F = "model.layers.*.feed_forward."
D = "decoder.layers.*.mlp."
CHUNKED = "chunked_attention"
FULL = "full_attention"

LLAMA4_WEIGHTS = LLAMA_WITHOUT_MLP + (
    M(D + "linear_fc1.weight", Kind.GATE_UP, (F + "gate_proj.weight", F + "up_proj.weight"), layers="dense"),
    M(D + "linear_fc2.weight", Kind.ROW, (F + "down_proj.weight",), layers="dense"),
    M(D + "router.weight", Kind.REPLICATED, (F + "router.weight",), layers="moe"),
    M(D + "experts.*.linear_fc1.weight", Kind.GATE_UP_PACKED, (F + "experts.gate_up_proj",), transposed=True,
      stacked_experts=True, layers="moe"),
    M(D + "experts.*.linear_fc2.weight", Kind.ROW, (F + "experts.down_proj",), transposed=True, stacked_experts=True,
      layers="moe"),
) + shared_expert_rows(hf_prefix=F + "shared_expert")


def rope_layers(hf_config) -> list[bool]:
    """Per layer, whether it rotates (HF `no_rope_layers`: 1 = RoPE, 0 = NoPE)."""
    return [bool(flag) for flag in hf_config.no_rope_layers[:hf_config.num_hidden_layers]]


def chunked_layers(hf_config) -> list[bool]:
    """Per layer, whether its attention is chunked (HF builds the chunked mask for these `layer_types`)."""
    return [kind == CHUNKED for kind in hf_config.layer_types[:hf_config.num_hidden_layers]]


def read_llama4_config(hf_config) -> dict:
    moe_layers = set(hf_config.moe_layers)
    no_rope = [int(not uses_rope) for uses_rope in rope_layers(hf_config)]
    return dict(
        num_moe_experts=hf_config.num_local_experts,
        moe_router_topk=1,
        moe_ffn_hidden_size=hf_config.intermediate_size,
        ffn_hidden_size=hf_config.intermediate_size_mlp,  # the dense layers' MLP
        moe_layer_freq=[int(i in moe_layers) for i in range(hf_config.num_hidden_layers)],
        moe_shared_expert_intermediate_size=hf_config.intermediate_size,
        moe_router_score_function="sigmoid",
        moe_apply_probs_on_input=True,
        # HF takes the top-1 of the router logits; megatron takes it of the sigmoid scores, which in bf16 round
        # together near 1 (logits 7 and 8 both give 1.0): an fp32 router picks HF's expert
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,  # SequentialMLP, as the other MoE families (families/moe.py)
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",  # Llama4ForCausalLM adds no load-balancing term
        moe_aux_loss_coeff=0.0,
        rotary_interleaved=True,
        no_rope_freq=no_rope if any(no_rope) else None,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
    )


def check_llama4_config(hf_config) -> list[str]:
    problems = []
    if hf_config.num_experts_per_tok != 1:
        problems.append(f"num_experts_per_tok={hf_config.num_experts_per_tok}: Llama 4 scales each expert's input by "
                        "its router score, which megatron-core's `moe_apply_probs_on_input` does for top-1 only "
                        "(every Llama 4 release routes top-1); set num_experts_per_tok: 1")
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True: the llama4 adapter reproduces the released layout without q / k / v / o "
                        "biases; set attention_bias: false")
    flags = list(hf_config.no_rope_layers or [])
    if len(flags) < hf_config.num_hidden_layers or set(flags) - {0, 1}:
        problems.append(f"no_rope_layers={flags}: one 0 (NoPE) or 1 (RoPE) per layer, for all "
                        f"{hf_config.num_hidden_layers} layers")
    layer_types = list(hf_config.layer_types or [])
    if len(layer_types) < hf_config.num_hidden_layers or set(layer_types) - {CHUNKED, FULL}:
        problems.append(f"layer_types={layer_types}: one {CHUNKED!r} or {FULL!r} per layer")
    elif CHUNKED in layer_types and not hf_config.attention_chunk_size:
        problems.append(f"layer_types has {CHUNKED!r} layers with attention_chunk_size="
                        f"{hf_config.attention_chunk_size}: set a chunk size, or make those layers {FULL!r}")
    bad_moe = sorted(set(hf_config.moe_layers) - set(range(hf_config.num_hidden_layers)))
    if bad_moe:
        problems.append(f"moe_layers has {bad_moe}, past the {hf_config.num_hidden_layers} layers")
    if hf_config.attn_temperature_tuning and float(hf_config.floor_scale) <= 0:
        problems.append(f"floor_scale={hf_config.floor_scale}: temperature tuning divides positions by it; "
                        "use a positive value (8192 as released)")
    _, _, rope_problem = rope_settings(hf_config)
    return problems + ([rope_problem] if rope_problem else [])


def read_llama4_quirks(hf_config) -> dict:
    """Per layer (0-based), what `Llama4AttentionInputs` does to its core attention's inputs."""
    uses_rope, chunked = rope_layers(hf_config), chunked_layers(hf_config)
    return {"attention_inputs": tuple(
        Llama4AttentionInputs(
            qk_norm_eps=float(hf_config.rms_norm_eps) if hf_config.use_qk_norm and rope else None,
            temperature=(float(hf_config.floor_scale), float(hf_config.attn_scale))
            if hf_config.attn_temperature_tuning and not rope else None,
            chunk_size=int(hf_config.attention_chunk_size) if chunk else None)
        for rope, chunk in zip(uses_rope, chunked))}


@dataclasses.dataclass(frozen=True)
class Llama4AttentionInputs:
    """Forward pre-hook of one layer's core attention (query [sq, b, heads, d], key, value, mask, ...), after RoPE:
    HF's q / k norm (`qk_norm_eps`), query temperature (`temperature` = (floor_scale, attn_scale)) and chunked
    mask (`chunk_size`); None leaves that part out."""

    qk_norm_eps: float | None = None
    temperature: tuple[float, float] | None = None
    chunk_size: int | None = None

    def __call__(self, module, args, kwargs):
        if len(args) < 4:  # megatron passes query, key, value, mask positionally (plain and recomputed calls)
            raise AdapterError(f"llama4: the core attention was called with {len(args)} positional arguments, not "
                               "query, key, value, mask: this megatron-core calls it otherwise than 0.16 did")
        query, key, value, mask, *rest = args
        if self.qk_norm_eps is not None:
            query, key = weightless_rms_norm(query, eps=self.qk_norm_eps), weightless_rms_norm(key, eps=self.qk_norm_eps)
        if self.temperature is None and self.chunk_size is None:
            return (query, key, value, mask, *rest), kwargs
        key_positions = token_positions(mask, seq_length=key.shape[0], device=query.device)
        positions = key_positions[:, -query.shape[0]:]  # the queries are the last sq positions (no cache: all)
        if self.temperature is not None:
            query = (query * query_temperature(positions, *self.temperature)).to(query.dtype)
        if self.chunk_size is not None and query.shape[0] > 1:
            mask = chunked_causal_mask(positions, key_positions=key_positions, chunk_size=self.chunk_size, given=mask)
        return (query, key, value, mask, *rest), kwargs


def token_positions(mask: torch.Tensor | None, *, seq_length: int, device) -> torch.Tensor:
    """[b or 1, s]: each token's position in its record: the column without packed records (mask None), else read
    from the packed mask (toolkit/adapters/packed.py), so each record chunks and scales as alone (as HF fed it)."""
    if mask is None:
        return torch.arange(seq_length, device=device).view(1, seq_length)
    return record_positions_from_mask(mask)


def weightless_rms_norm(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """HF's `Llama4TextWeightlessRMSNorm`: x / rms(x) over the head in fp32, back to x's dtype."""
    x_float = x.float()
    return (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def query_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """[sq, b or 1, 1, 1] fp32 factors, log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at position p, as HF
    (`positions` [b or 1, sq])."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return scales.transpose(0, 1)[:, :, None, None]


def chunked_causal_mask(query_positions: torch.Tensor, *, key_positions: torch.Tensor, chunk_size: int,
                        given: torch.Tensor | None) -> torch.Tensor:
    """megatron's boolean mask (True = masked) [b or 1, 1, sq, sk]: a key in another chunk of `chunk_size`
    positions of the record than the query, or (without a `given` packed mask, which already has it) later than
    the query; combined with `given` (packed records: their own causal block-diagonal mask)."""
    query_chunk = torch.div(query_positions, chunk_size, rounding_mode="floor")[:, :, None]
    key_chunk = torch.div(key_positions, chunk_size, rounding_mode="floor")[:, None, :]
    outside = (query_chunk != key_chunk)[:, None]
    if given is not None:
        return given.to(torch.bool) | outside
    sq, sk = query_positions.shape[1], key_positions.shape[1]
    later = torch.ones(sq, sk, dtype=torch.bool, device=outside.device).triu(sk - sq + 1)  # no cache: sq == sk
    return outside | later


def edit_llama4_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """HF's fp32 rotation (ERNIE 4.5's attention class); Transformer Engine refused by name."""
    if transformer_engine:
        raise AdapterError("llama4 with Transformer Engine layers: its chunked-attention mask and per-position query "
                           "temperature are written for megatron's local attention; set training.attention: local")
    return edit_ernie4_5_layer_spec(spec, config=config, settings=settings, transformer_engine=transformer_engine)


def edit_llama4_model(model, *, settings) -> None:
    """Each layer's core attention gets its `Llama4AttentionInputs` by the layer's global 1-based layer_number."""
    per_layer = settings.quirks["attention_inputs"]
    for layer in model.decoder.layers:
        hook = per_layer[layer.layer_number - 1]
        if hook != Llama4AttentionInputs():
            layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)


LLAMA4_TEXT = register(ModelFamily(
    model_type="llama4_text", hf_architecture="Llama4ForCausalLM", weights=LLAMA4_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(local_layers_only=LLAMA4_LOCAL), read_config=read_llama4_config,
    check_config=check_llama4_config, read_quirks=read_llama4_quirks, edit_layer_spec=edit_llama4_layer_spec,
    edit_model=edit_llama4_model,
))
