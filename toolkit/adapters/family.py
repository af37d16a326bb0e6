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


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """One row of a weight table: a megatron parameter (layout-free name, `*` = global layer index), its kind, and
    the HF tensor name(s) it is made from, in the order the kind expects (QKV: q, k, v; GATE_UP: gate, up)."""

    megatron: str
    kind: Kind
    hf: tuple[str, ...]

    def __post_init__(self):
        if len(self.hf) != HF_ARITY[self.kind]:
            raise ValueError(f"{self.megatron}: kind {self.kind.value} takes {HF_ARITY[self.kind]} HF names, got {self.hf}")

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron

    def for_layer(self, layer: int | None) -> tuple[str, tuple[str, ...]]:
        """Concrete (megatron name, HF names) for one layer (layer=None for non-layer rows)."""
        if layer is None:
            return self.megatron, self.hf
        index = str(layer)
        return self.megatron.replace("*", index), tuple(name.replace("*", index) for name in self.hf)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    model_type: str  # HF config.model_type
    hf_architecture: str  # HF class written into exported config.json ("LlamaForCausalLM")
    weights: tuple[WeightMapping, ...]
    # Rows used only when input and output embeddings are separate (HF tie_word_embeddings=False).
    untied_output: WeightMapping
    # HF tensor names (with `*`) that carry no megatron parameter and are dropped on purpose.
    ignored_hf: tuple[str, ...] = ()
    # TransformerConfig fields this family sets differently from the shared translation (e.g. add_qkv_bias).
    config_deltas: dict = dataclasses.field(default_factory=dict)
    # Refuses config features megatron-core cannot reproduce; returns a list of problems (empty when fine).
    check_config: Callable[[object], list[str]] = lambda hf_config: []

    def weight_table(self, *, tied_embeddings: bool) -> tuple[WeightMapping, ...]:
        return self.weights if tied_embeddings else self.weights + (self.untied_output,)


_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.model_type in _REGISTRY:
        raise ValueError(f"model_type {family.model_type!r} registered twice")
    _REGISTRY[family.model_type] = family
    return family


def _load_families() -> None:
    from toolkit.adapters import families

    for module in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{module.name}")


def supported_model_types() -> list[str]:
    if not _REGISTRY:
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
