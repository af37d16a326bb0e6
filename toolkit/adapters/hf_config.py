"""HF config -> megatron-core settings: one shared translation table; families override only their deltas."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from toolkit.adapters.family import (AdapterError, HeadTable, ModelFamily, Multipliers, WeightMapping, expand_table,
                                     get_family)
from toolkit.adapters.longrope import longrope_from_hf
from toolkit.adapters.transforms import ShapeContext
from toolkit.models.remote_code import refuse_remote_code
from toolkit.models.shapes import VOCAB_PAD_MULTIPLE, padded_vocab_size  # one rule for adapters, spec and planner

# (HF config field, megatron TransformerConfig field), copied as they are.
SHARED_CONFIG_TABLE = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_query_groups"),
    ("intermediate_size", "ffn_hidden_size"),
    ("rms_norm_eps", "layernorm_epsilon"),
)

# What every supported family shares and HF never states: no dropout unless the family reads its own (GPT-2 and
# BERT do, in `read_config`; the Llama-like ones have none, or refuse it), and no CUDA-only fusions (they would be picked on GPU by megatron defaults but need apex / TE
# kernels; correctness first, the engine may switch them on where present). The layer deltas (activation, norm,
# biases, qk-norm) come from the family's `Architecture`.
SHARED_CONFIG_CONSTANTS = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
)

# HF activation names (transformers' ACT2FN keys) -> `Architecture.activation`; only exact equivalents.
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}

DEFAULT_VOCAB_PAD_MULTIPLE = VOCAB_PAD_MULTIPLE  # see toolkit/models/shapes.py for why it is not multiplied by tp

# Llama-3 rope scaling constants megatron-core 0.16 hard-codes in RotaryEmbedding._apply_scaling.
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def load_hf_config(checkpoint_dir: Path):
    """The HF config through transformers' own loader, with errors that say what to fix."""
    from transformers import AutoConfig

    config_path = Path(checkpoint_dir) / "config.json"
    if not Path(checkpoint_dir).is_dir():
        raise AdapterError(f"checkpoint directory {checkpoint_dir} does not exist (or is not a directory)")
    if not config_path.is_file():
        raise AdapterError(f"{config_path} is missing: an HF checkpoint directory needs config.json (save_pretrained writes it)")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{config_path} is not readable JSON ({err}); re-save the config with save_pretrained") from err
    # before the family: its model_type may be the folder's own code's
    refuse_remote_code(checkpoint_dir, only=("config.json",))
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise AdapterError(f"{config_path} has no 'model_type'; it is not an HF model config")
    get_family(model_type)  # unknown model types fail here, listing the supported ones
    return AutoConfig.from_pretrained(str(checkpoint_dir), trust_remote_code=False)


def rope_parameters(hf_config) -> dict:
    """The model's RoPE parameters from a transformers 4 (`rope_scaling` + `rope_theta`) or 5 (`rope_parameters`)
    config, with `rope_theta` and `rope_type` always set."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    # Per layer type (Gemma 3): the global layers' RoPE is the model's; the local layers' is the family's own.
    params, scaling = (part.get("full_attention", part) or {} for part in (params, scaling))
    merged = {**scaling, **params}
    merged["rope_theta"] = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    merged["rope_type"] = merged.get("rope_type", merged.get("type", "default"))
    return merged


# Model types whose transformers attention rotates only the first int(head_dim * partial_rotary_factor) dims of each
# head (phi3's and glm4_moe's `apply_rotary_pos_emb` split q / k into rotated and passed parts, rotate_half over the
# rotated part): megatron's `rotary_percent`, the same split. Other families' HF models ignore the field (Llama).
PARTIAL_ROTARY_MODEL_TYPES = ("phi3", "glm4_moe", "qwen3_next")


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def partial_rotary(hf_config, *, params: dict) -> tuple[float, int, str | None]:
    """(partial_rotary_factor, the rotated width of each head, problem or None). The width is HF's
    int(head_dim * factor), which is megatron's int(kv_channels * rotary_percent) for rotary_percent = the factor."""
    head_dim = head_dim_of(hf_config)
    if hf_config.model_type not in PARTIAL_ROTARY_MODEL_TYPES:
        return 1.0, head_dim, None
    factor = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    width = int(head_dim * factor)
    if not 0 < width <= head_dim or width % 2:
        return factor, head_dim, (f"partial_rotary_factor={factor}: rotates {width} of head_dim {head_dim} dims; "
                                  f"RoPE needs an even width in (0, {head_dim}]. Fix: correct config.json")
    return factor, width, None


def rope_settings(hf_config) -> tuple[float, dict | None, str | None]:
    """(rope_theta, megatron rope-scaling kwargs or None, problem or None), for transformers 4 and 5 configs. The
    kwargs go to GPTModel (`rotary_percent`: partial rotary) except build.py's own `longrope` and `linear_factor`."""
    merged = rope_parameters(hf_config)
    factor, width, problem = partial_rotary(hf_config, params=merged)
    if problem:
        return merged["rope_theta"], None, problem
    theta, scaling, problem = _rope_scaling(hf_config, merged=merged, rotary_dim=width)
    if problem is None and width != head_dim_of(hf_config):
        scaling = {**(scaling or {}), "rotary_percent": factor}
    return theta, scaling, problem


def _rope_scaling(hf_config, *, merged: dict, rotary_dim: int) -> tuple[float, dict | None, str | None]:
    theta, rope_type = merged["rope_theta"], merged["rope_type"]
    if rope_type == "default":
        return theta, None, None
    if rope_type == "linear":  # HF divides the inverse frequencies by the factor; so does build.py
        return theta, {"linear_factor": float(merged["factor"])}, None
    if rope_type == "llama3":
        wrong = {k: merged.get(k) for k, v in _MCORE_LLAMA3_ROPE.items() if float(merged.get(k, v)) != v}
        if wrong:
            return theta, None, (
                f"rope_scaling llama3 with {wrong}: megatron-core fixes "
                f"{_MCORE_LLAMA3_ROPE}; this checkpoint's scaling cannot be reproduced"
            )
        return theta, {"rope_scaling": True, "rope_scaling_factor": float(merged.get("factor", 8.0))}, None
    if rope_type == "longrope":  # Phi-3 long context: a rotary module of its own (toolkit/adapters/longrope.py)
        if hf_config.model_type != "phi3":
            return theta, None, f"rope_type 'longrope' is supported for phi3 only (this is {hf_config.model_type})"
        longrope, problem = longrope_from_hf(hf_config, params=merged, theta=theta, rotary_dim=rotary_dim)
        return theta, (None if problem else {"longrope": longrope}), problem
    return theta, None, f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3; longrope for phi3)"


def activation_problems(hf_config, *, family: ModelFamily) -> list[str]:
    """The checkpoint's activation (config field `family.hf_activation_field`) must be the family's."""
    name = getattr(hf_config, family.hf_activation_field, None)
    if HF_ACTIVATIONS.get(name) == family.architecture.activation:
        return []
    same = sorted(hf for hf, kind in HF_ACTIVATIONS.items() if kind == family.architecture.activation)
    return [f"{family.hf_activation_field}={name!r}; the {family.model_type} adapter reproduces only "
            f"{' / '.join(repr(n) for n in same)} (megatron {family.architecture.activation})"]


@dataclasses.dataclass(frozen=True)
class EncoderSettings:
    """What an encoder checkpoint (BERT) needs beyond the TransformerConfig: its head (from config.architectures),
    the head's sizes, and the token-type vocabulary (megatron's `num_tokentypes`)."""

    head: HeadTable
    num_tokentypes: int  # HF type_vocab_size
    num_labels: int = 0  # sequence classification: outputs of the classifier (1 = regression)
    classifier_dropout: float = 0.0  # HF classifier_dropout, else hidden_dropout_prob
    padding_idx: int | None = None  # HF pad_token_id: the word-embedding row its lookups do not train

    @property
    def task(self) -> str:
        return self.head.task


def encoder_settings(hf_config, *, family: ModelFamily) -> EncoderSettings | None:
    if not family.is_encoder:
        return None
    head = family.head_for(getattr(hf_config, "architectures", None))
    dropout = getattr(hf_config, "classifier_dropout", None)
    return EncoderSettings(
        head=head, num_tokentypes=int(getattr(hf_config, "type_vocab_size", 0) or 0),
        num_labels=int(hf_config.num_labels) if head.task == "sequence_classification" else 0,
        classifier_dropout=float(getattr(hf_config, "hidden_dropout_prob", 0.0) if dropout is None else dropout),
        padding_idx=getattr(hf_config, "pad_token_id", None),
    )


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Everything needed to build the megatron model of one HF config, independent of the parallel layout."""

    family: ModelFamily
    transformer_fields: dict  # TransformerConfig kwargs (layout and dtype fields are added by build.py)
    vocab_size: int
    padded_vocab_size: int
    max_position_embeddings: int
    tied_embeddings: bool
    rotary_base: float
    rope_scaling: dict | None
    encoder: EncoderSettings | None = None  # encoder families (BERT) only
    multipliers: Multipliers = Multipliers()  # embedding / residual / logits factors (Granite)
    # The family's own settings megatron has no field for (`ModelFamily.read_quirks`: Gemma 2's softcaps).
    quirks: dict = dataclasses.field(default_factory=dict)
    # HF tensors kept bit-exact, not loaded (read_passthrough): `*` a number, a trailing `.*` any rest of the name.
    passthrough_hf: tuple[str, ...] = ()
    # This config's rows of the family table, where the family picks them per config (`ModelFamily.read_weights`).
    rows: tuple[WeightMapping, ...] | None = None

    @property
    def attention_softcap(self) -> float | None:
        """HF's `attn_logit_softcapping` (Gemma 2): scores -> cap * tanh(scores / cap) before the mask; only
        megatron's local attention reproduces it (toolkit/adapters/softcap.py)."""
        return self.quirks.get("attn_logit_softcapping")

    @property
    def num_layers(self) -> int:
        return self.transformer_fields["num_layers"]

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0: a dense model)."""
        return self.transformer_fields.get("num_moe_experts") or 0

    @property
    def moe_layers(self) -> frozenset[int]:
        """The indices of the MoE layers: all of an MoE model's unless its `moe_layer_freq` pattern (megatron's
        list of 1 = MoE, 0 = dense per layer) says otherwise; none of a dense model's."""
        if not self.num_experts:
            return frozenset()
        pattern = self.transformer_fields.get("moe_layer_freq", 1)
        if isinstance(pattern, int):
            return frozenset(i for i in range(self.num_layers) if i % pattern == 0)
        return frozenset(i for i, moe in enumerate(pattern) if moe)

    def weight_table(self) -> tuple[WeightMapping, ...]:
        """The family's rows, plus the head's for an encoder (and the untied output layer where there is one)."""
        if self.encoder is None:
            return self.family.weight_table(tied_embeddings=self.tied_embeddings, rows=self.rows)
        has_output_layer = self.encoder.task == "masked_lm"
        return self.family.weight_table(tied_embeddings=self.tied_embeddings or not has_output_layer, rows=self.rows) \
            + self.encoder.head.weights

    def load_items(self) -> dict:
        """Every concrete row of the weight table: canonical megatron name -> `toolkit.adapters.family.LoadItem`."""
        return expand_table(self.weight_table(), num_layers=self.num_layers, num_experts=self.num_experts,
                            moe_layers=self.moe_layers)

    def ignored_hf(self) -> tuple[str, ...]:
        """HF tensor names (with `*`) the conversion drops on purpose."""
        head = self.encoder.head.ignored_hf if self.encoder is not None else ()
        return self.family.ignored_hf + head + (("lm_head.weight",) if self.tied_embeddings else ())

    def shape_context(self) -> ShapeContext:
        fields = self.transformer_fields
        return ShapeContext(
            num_attention_heads=fields["num_attention_heads"], num_query_groups=fields["num_query_groups"],
            head_dim=fields["kv_channels"], vocab_size=self.vocab_size, padded_vocab_size=self.padded_vocab_size,
        )


def model_settings(hf_config, *, vocab_pad_multiple: int = DEFAULT_VOCAB_PAD_MULTIPLE, tensor_names=None,
                   family: ModelFamily | None = None) -> ModelSettings:
    """`tensor_names`: the checkpoint's HF tensor names where known (a multimodal checkpoint's naming and tying
    depend on them); `family`: the family reading `hf_config` where its model_type names none (a text_config)."""
    family = family or get_family(hf_config.model_type)
    if family.multimodal_settings is not None:  # its language model's settings (toolkit/adapters/multimodal.py)
        return family.multimodal_settings(hf_config, vocab_pad_multiple=vocab_pad_multiple, tensor_names=tensor_names)
    problems = activation_problems(hf_config, family=family) + family.check_config(hf_config)
    if problems:
        raise AdapterError(f"{hf_config.model_type} config uses features dsmt cannot reproduce:\n  - " + "\n  - ".join(problems))
    fields = {mcore: getattr(hf_config, hf, None) for hf, mcore in SHARED_CONFIG_TABLE}
    fields["num_query_groups"] = fields["num_query_groups"] or fields["num_attention_heads"]
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    fields["kv_channels"] = head_dim
    fields.update(SHARED_CONFIG_CONSTANTS)
    fields.update(family.architecture.transformer_fields())
    fields.update(family.read_config(hf_config))
    # The shared fields must be read; a family may set others to None on purpose (MLA's q_lora_rank).
    shared = {mcore for _, mcore in SHARED_CONFIG_TABLE} | {"kv_channels"}
    missing = sorted(name for name, value in fields.items() if value is None and name in shared)
    if missing:
        raise AdapterError(f"{hf_config.model_type} config leaves megatron fields {missing} unset; the "
                           f"{family.model_type} family must read them (ModelFamily.read_config)")
    theta, scaling, _ = rope_settings(hf_config)
    longrope = (scaling or {}).get("longrope")  # HF's cos/sin magnitude: a score scale where the whole head rotates
    if longrope is not None and longrope.softmax_scale() is not None:  # (else on cos / sin: toolkit/adapters/longrope.py)
        fields["softmax_scale"] = longrope.softmax_scale()
    encoder = encoder_settings(hf_config, family=family)
    # An encoder without an MLM head has no output layer to tie (BERT configs say tie_word_embeddings=True anyway).
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and (encoder is None or encoder.task == "masked_lm")
    return ModelSettings(
        family=family, transformer_fields=fields, vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded_vocab_size(hf_config.vocab_size, multiple=vocab_pad_multiple),
        max_position_embeddings=hf_config.max_position_embeddings,
        tied_embeddings=tied, rotary_base=float(theta), rope_scaling=scaling, encoder=encoder,
        multipliers=family.read_multipliers(hf_config), quirks=family.read_quirks(hf_config),
        passthrough_hf=tuple(family.read_passthrough(hf_config)),
        rows=None if family.read_weights is None else tuple(family.read_weights(hf_config)),
    )
