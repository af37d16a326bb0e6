"""A model family: which HF `model_type` it serves, how its config differs from the shared translation, and its
declarative weight table. Families register themselves (`@register`) from one small file each in `families/`."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Callable

from toolkit.adapters.transforms import HF_ARITY, Kind
from toolkit.errors import DsmtError


class AdapterError(DsmtError):
    """A checkpoint or config the adapters cannot convert as asked."""


LAYER_KINDS = ("all", "dense", "moe")


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """One row of a weight table: a megatron parameter (layout-free name, `*` = global layer index; in an expert's
    row a second `*` = global expert index), its kind, and the HF tensor name(s) it is made from, in the order the
    kind expects (QKV: q, k, v; GATE_UP: gate, up)."""

    megatron: str
    kind: Kind
    hf: tuple[str, ...]
    # The HF tensors are stored [in, out] (GPT-2's Conv1D) rather than torch.nn.Linear's [out, in].
    transposed: bool = False
    # Which layers have the row, in a model that mixes dense and MoE layers (DeepSeek's dense first layers,
    # Qwen2-MoE's mlp_only_layers): one of LAYER_KINDS.
    layers: str = "all"
    # An expert's row whose HF tensors hold every expert of the layer stacked on dim 0 (GPT-OSS's
    # `mlp.experts.gate_up_proj` [E, ...]): the HF names carry the layer `*` only, and expert e is slice e.
    stacked_experts: bool = False

    def __post_init__(self):
        if self.layers not in LAYER_KINDS:
            raise ValueError(f"{self.megatron}: layers={self.layers!r}; one of {LAYER_KINDS}")
        if len(self.hf) != HF_ARITY[self.kind]:
            raise ValueError(f"{self.megatron}: kind {self.kind.value} takes {HF_ARITY[self.kind]} HF names, got {self.hf}")
        wildcards = self.megatron.count("*")
        if self.stacked_experts and wildcards != 2:
            raise ValueError(f"{self.megatron}: stacked_experts is for an expert's row (layer and expert `*`)")
        hf_wildcards = wildcards - 1 if self.stacked_experts else wildcards
        if wildcards > 2 or any(name.count("*") != hf_wildcards for name in self.hf):
            raise ValueError(f"{self.megatron}: every name of a row has the same `*`s (layer, then expert; HF names "
                             f"of stacked experts the layer's only); got {self.hf}")

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron

    @property
    def per_expert(self) -> bool:
        return self.megatron.count("*") == 2

    def for_layer(self, layer: int | None, expert: int | None = None) -> tuple[str, tuple[str, ...]]:
        """Concrete (megatron name, HF names) for one layer (layer=None for non-layer rows) and, in an expert's
        row, one expert."""
        if layer is None:
            return self.megatron, self.hf

        def concrete(name: str) -> str:
            name = name.replace("*", str(layer), 1)
            return name.replace("*", str(expert), 1) if expert is not None else name

        return concrete(self.megatron), tuple(concrete(name) for name in self.hf)


@dataclasses.dataclass(frozen=True)
class LoadItem:
    megatron: str
    kind: Kind
    hf: tuple[str, ...]
    transposed: bool = False  # HF stores the tensors [in, out] (Conv1D)
    expert_slice: int | None = None  # the HF tensors stack the experts on dim 0: this row is slice `expert_slice`


def expand_table(table: tuple[WeightMapping, ...], *, num_layers: int, num_experts: int = 0,
                 moe_layers: frozenset[int] | None = None) -> dict[str, LoadItem]:
    """Every concrete (megatron name -> HF names) row of the model (expert rows once per global expert). A row
    for `dense` / `moe` layers only expands for those layers (`moe_layers`: the MoE layers' indices; None: every
    layer of an MoE model is MoE, and of a dense model dense)."""
    if moe_layers is None:
        moe_layers = frozenset(range(num_layers)) if num_experts else frozenset()
    chosen = {"all": range(num_layers), "moe": sorted(moe_layers),
              "dense": [i for i in range(num_layers) if i not in moe_layers]}
    items = {}
    for row in table:
        for layer in (chosen[row.layers] if row.per_layer else [None]):
            for expert in (range(num_experts) if row.per_expert else [None]):
                megatron, hf = row.for_layer(layer, expert)
                items[megatron] = LoadItem(megatron, row.kind, hf, row.transposed,
                                           expert if row.stacked_experts else None)
    return items


def gelu_tanh(x):
    """GELU with the tanh approximation (HF `gelu_pytorch_tanh`, `gelu_new`)."""
    import torch

    return torch.nn.functional.gelu(x, approximate="tanh")


def _activations() -> dict[str, Callable]:
    import torch

    return {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "gelu_tanh": gelu_tanh}


ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How a family's layers differ from the shared Llama-like decoder: the family deltas build.py and the
    planner read. The defaults are Llama: SwiGLU, pre-norm RMSNorm, no biases, RoPE."""

    activation: str = "silu"  # one of ACTIVATIONS
    gated_mlp: bool = True  # fc1 = [gate; up], act(gate) * up (SwiGLU / GeGLU); else act(fc1(x))
    normalization: str = "RMSNorm"  # one of NORMALIZATIONS
    zero_centered_norm: bool = False  # the norm scales by (1 + w) (Gemma), megatron's zero-centred gamma
    qk_norm: bool = False  # an RMSNorm over each query and key head, before RoPE (Qwen3)
    # The q / k norms span all heads (OLMo-2): each TP rank must hold whole KV heads (tp divides num_kv_heads).
    qk_norm_spans_heads: bool = False
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2)
    linear_bias: bool = False  # biases on every linear layer (GPT-2)
    embedding_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    position_embedding: str = "rope"  # one of POSITION_EMBEDDINGS
    # Why the family's layers exist on megatron's local layers only (its edit_layer_spec refuses Transformer
    # Engine's: Qwen3-Next, Llama 4), or None: verify / convert then build local layers, and dsmt check / plan know it
    local_layers_only: str | None = None

    def __post_init__(self):
        for field, value, allowed in (("activation", self.activation, ACTIVATIONS),
                                      ("normalization", self.normalization, NORMALIZATIONS),
                                      ("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)):
            if value not in allowed:
                raise ValueError(f"Architecture.{field}={value!r}; one of {allowed}")

    @property
    def activation_func(self) -> Callable:
        return _activations()[self.activation]

    def transformer_fields(self) -> dict:
        """The megatron TransformerConfig fields these deltas set."""
        return dict(activation_func=self.activation_func, gated_linear_unit=self.gated_mlp,
                    normalization=self.normalization, layernorm_zero_centered_gamma=self.zero_centered_norm,
                    qk_layernorm=self.qk_norm, add_bias_linear=self.linear_bias,
                    add_qkv_bias=self.qkv_bias or self.linear_bias)


@dataclasses.dataclass(frozen=True)
class Multipliers:
    """Scalar factors some families put where megatron-core's GPTModel has none (Granite): the embeddings times
    `embedding`, each attention / MLP output times `residual` before its residual add, the logits divided by
    `logits_divisor`. Read from the HF config (`ModelFamily.read_multipliers`); 1.0 leaves that place as it is."""

    embedding: float = 1.0
    residual: float = 1.0
    logits_divisor: float = 1.0


ENCODER_TASKS = ("masked_lm", "sequence_classification")


@dataclasses.dataclass(frozen=True)
class HeadTable:
    """An encoder family's head for one HF class (BERT): the training task it implies, the weight rows of the head
    (added to the family's `weights`), and HF tensors a checkpoint of that class may carry and the head drops."""

    hf_architecture: str  # the HF class in config.architectures[0] ("BertForSequenceClassification")
    task: str  # one of ENCODER_TASKS
    weights: tuple[WeightMapping, ...]
    ignored_hf: tuple[str, ...] = ()

    def __post_init__(self):
        if self.task not in ENCODER_TASKS:
            raise ValueError(f"HeadTable.task={self.task!r}; one of {ENCODER_TASKS}")


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    model_type: str  # HF config.model_type
    hf_architecture: str  # HF class written into exported config.json ("LlamaForCausalLM")
    weights: tuple[WeightMapping, ...]
    # Rows used only when input and output embeddings are separate (HF tie_word_embeddings=False).
    untied_output: WeightMapping
    # HF tensor names (with `*`) that carry no megatron parameter and are dropped on purpose.
    ignored_hf: tuple[str, ...] = ()
    # The family's layer deltas (activation, norm, qk-norm, biases, embedding scale, position embedding).
    architecture: Architecture = Architecture()
    # HF config -> TransformerConfig fields read differently from the shared table (GPT-2's n_inner,
    # layer_norm_epsilon); applied after the shared translation.
    read_config: Callable[[object], dict] = lambda hf_config: {}
    # The HF config field naming the activation (checked against `architecture.activation`).
    hf_activation_field: str = "hidden_act"
    # Refuses config features megatron-core cannot reproduce; returns a list of problems (empty when fine).
    check_config: Callable[[object], list[str]] = lambda hf_config: []
    # HF config -> the family's scalar multipliers (build.py applies them; Granite).
    read_multipliers: Callable[[object], Multipliers] = lambda hf_config: Multipliers()
    # Replaces submodules of the layer spec where megatron-core's layer lacks the family's computation (OLMo-2's
    # post-norms and whole-projection q / k norms):
    # `edit_layer_spec(spec, config=, settings=, transformer_engine=)` -> spec.
    edit_layer_spec: Callable | None = None
    # HF config -> the family's settings that megatron's TransformerConfig has no field for (Gemma 2's softcaps,
    # Gemma 3's local RoPE base), kept in `ModelSettings.quirks` for the family's edit hooks.
    read_quirks: Callable[[object], dict] = lambda hf_config: {}
    # Changes a built GPTModel (a pipeline stage) where the change is outside the layers (Gemma 2's final-logit
    # softcap, Gemma 3's per-layer RoPE): `edit_model(model, settings=)`, in place.
    edit_model: Callable | None = None
    # HF config -> HF tensor names (with `*`) the model does not use but a checkpoint as published carries and a
    # round trip must keep bit-exact (DeepSeek-V3's multi-token-prediction layers): conversion stores them beside
    # the megatron checkpoint and writes them back; training names them as ignored and its export copies them.
    read_passthrough: Callable[[object], tuple[str, ...]] = lambda hf_config: ()
    # HF config -> the subset of `weights` one checkpoint has, where the config decides which rows exist
    # (DeepSeek's q projection: one matrix, or a low-rank pair with its norm). None: every row of `weights`.
    read_weights: Callable[[object], tuple[WeightMapping, ...]] | None = None
    # Encoder families only (BERT): the model is toolkit/adapters/encoder.py's post-LN encoder, not GPTModel, and its
    # head is the one named by config.architectures[0]. Empty for decoder families.
    heads: tuple[HeadTable, ...] = ()
    # A multimodal checkpoint's family (toolkit/adapters/multimodal.py): `multimodal_settings(hf_config,
    # vocab_pad_multiple=, tensor_names=)` -> the settings of its language model in the checkpoint's tensor names
    # (`hf_config.model_settings` hands over to it). None for a text model.
    multimodal_settings: Callable | None = None
    # transformers 5's module path (`*` = layer) of the fused routed experts (3-D gate_up_proj / down_proj), which
    # PEFT adapts with `target_parameters` (toolkit/adapters/peft_names.py): set where dsmt's LoRA adapts the
    # family's experts; None (an MoE family): its experts take no adapter.
    peft_experts: str | None = None

    @property
    def is_encoder(self) -> bool:
        return bool(self.heads)

    def head_for(self, architectures) -> HeadTable:
        """The head of an encoder checkpoint whose config.architectures is `architectures`."""
        names = list(architectures or [])
        for head in self.heads:
            if names and names[0] == head.hf_architecture:
                return head
        supported = ", ".join(head.hf_architecture for head in self.heads)
        raise AdapterError(f"architectures={names} ({self.model_type}): dsmt's {self.model_type} adapter has no "
                           f"such head; supported: {supported}. Save the model with one of these classes "
                           f"(e.g. AutoModelForSequenceClassification.from_pretrained(path, num_labels=N))")

    def weight_table(self, *, tied_embeddings: bool, rows: tuple[WeightMapping, ...] | None = None
                     ) -> tuple[WeightMapping, ...]:
        """The family's rows (or `rows`, a config's subset of them: `read_weights`), plus the output layer's."""
        rows = self.weights if rows is None else rows
        return rows if tied_embeddings else rows + (self.untied_output,)


_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.model_type in _REGISTRY:
        raise ValueError(f"model_type {family.model_type!r} registered twice")
    _REGISTRY[family.model_type] = family
    return family


def _load_families() -> None:
    """Import every family file once. Not keyed on an empty registry: a family module imported first on its own
    (a test, a user's script) registers itself, and the others must still load."""
    from toolkit.adapters import families

    if getattr(_load_families, "done", False):
        return
    for module in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{module.name}")
    _load_families.done = True


def supported_model_types() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def get_family(model_type: str) -> ModelFamily:
    supported = supported_model_types()
    if model_type not in _REGISTRY:
        raise AdapterError(
            f"model_type {model_type!r} has no megatron-core adapter; supported: {', '.join(supported)}. "
            "Other models can still train with DeepSpeed data parallelism only (tp=pp=1)."
        )
    return _REGISTRY[model_type]
