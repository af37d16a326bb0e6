"""`training.method` and `training.dpo`: preference tuning (toolkit/train/engine/preference.py).

    method: sft   the language-model loss on the counted tokens (default)
    method: dpo   Direct Preference Optimization on `data.type: preference` pairs, against a frozen reference
    method: simpo SimPO on the same pairs, reference-free (`training.simpo`: SimpoSpec)
    method: orpo  ORPO on the same pairs, reference-free, with the chosen completions' NLL (`training.orpo`)

`training.dpo` takes TRL's `DPOConfig` names and meanings:
  beta             the deviation from the reference (IPO: its regularisation tau); > 0, default 0.1
  loss             sigmoid (DPO), ipo (IPO: log-ratios averaged over each completion's tokens), hinge (SLiC)
  label_smoothing  the probability that a preference is flipped (conservative DPO, sigmoid only), in [0, 0.5)
  reference        base: the starting checkpoint (under LoRA the same model with its adapters off, no second copy;
                   full fine-tuning: a frozen copy at the policy's TP x PP); precomputed: its log-probs computed
                   once before training, next to the data cache; or a path to another HF checkpoint of the same
                   shapes
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from toolkit.spec.sections import Section, _safe_path

PREFERENCE_METHODS = ("dpo", "simpo", "orpo")  # training.method values that train on pairs; the tasks' names too
REFERENCE_KINDS = ("base", "precomputed")  # anything else is a path
# Rules raised below (toolkit/spec/schema.py SCHEMA_RULES lists them with the others).
PREFERENCE_RULES = frozenset({"dpo_beta", "dpo_label_smoothing", "dpo_without_method"})


class DpoSpec(Section):
    beta: float = 0.1
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    reference: str = "base"

    @model_validator(mode="after")
    def _consistent(self):
        if not self.beta > 0:
            raise PydanticCustomError(
                "dpo_beta", "training.dpo.beta={beta} must be above 0: it scales the log-ratios (TRL's default 0.1; "
                "typical 0.01 to 0.5)", {"beta": self.beta})
        if self.label_smoothing and self.loss != "sigmoid":
            raise PydanticCustomError(
                "dpo_label_smoothing", "training.dpo.label_smoothing={eps} applies to the sigmoid loss only "
                "(conservative DPO); loss={loss} has no smoothing: set label_smoothing: 0 or loss: sigmoid",
                {"eps": self.label_smoothing, "loss": self.loss})
        _safe_path(self.reference, what="training.dpo.reference")
        return self

    @property
    def reference_path(self) -> str | None:
        """The reference checkpoint directory when `reference` is a path; None for base / precomputed."""
        return None if self.reference in REFERENCE_KINDS else self.reference


class SimpoSpec(Section):
    """SimPO (Meng et al. 2024; TRL's CPOTrainer with loss_type simpo and cpo_alpha 0): reference-free, on each
    completion's AVERAGE log-prob: -(1 - eps) logsigmoid(beta (avg_c - avg_r) - gamma) - eps logsigmoid(-(...)).
    `gamma` is TRL's `simpo_gamma`, the paper's target margin; the defaults are the paper's (beta 2, gamma/beta
    0.5), not CPOConfig's (made for CPO)."""

    beta: float = Field(2.0, gt=0)
    gamma: float = Field(1.0, ge=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)


class OrpoSpec(Section):
    """ORPO (Hong et al. 2024; TRL's ORPOTrainer): reference-free, the chosen completions' NLL (per token over the
    global batch, as SFT's loss) minus beta times the mean log-sigmoid of the odds ratio of the average log-probs.
    `beta` is TRL's ORPOConfig.beta, the paper's lambda."""

    beta: float = Field(0.1, gt=0)


def check_method(*, method: str, settings: dict) -> None:
    """training.dpo / simpo / orpo belong to their method (a spec that sets one under another would silently train
    that other method)."""
    for name, value in settings.items():
        if value is not None and method != name:
            raise PydanticCustomError(
                "dpo_without_method", "training.{name} is set but training.method={method}: set training.method: "
                "{name}, or remove training.{name}", {"name": name, "method": method})


def preference_settings(training):
    """(method, its settings) of a `TrainingSpec` for a preference method (defaults when its section is left out);
    None for SFT."""
    if training.method not in PREFERENCE_METHODS:
        return None
    given = getattr(training, training.method)
    defaults = {"dpo": DpoSpec, "simpo": SimpoSpec, "orpo": OrpoSpec}
    return training.method, given if given is not None else defaults[training.method]()


def dpo_settings(training) -> DpoSpec | None:
    """The DPO settings of a `TrainingSpec` (defaults when method: dpo leaves training.dpo out); None otherwise."""
    found = preference_settings(training)
    return found[1] if found is not None and found[0] == "dpo" else None
