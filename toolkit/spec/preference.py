"""`training.method` and `training.dpo`: preference tuning (toolkit/train/engine/preference.py).

    method: sft   the language-model loss on the counted tokens (default)
    method: dpo   Direct Preference Optimization on `data.type: preference` pairs, against a frozen reference

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

METHODS = ("sft", "dpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
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


def check_method(*, method: str, dpo: DpoSpec | None) -> None:
    """training.dpo belongs to method: dpo (a spec that sets it under sft would silently train SFT)."""
    if dpo is not None and method != "dpo":
        raise PydanticCustomError(
            "dpo_without_method", "training.dpo is set but training.method={method}: set training.method: dpo, or "
            "remove training.dpo", {"method": method})


def dpo_settings(training) -> DpoSpec | None:
    """The DPO settings of a `TrainingSpec` (defaults when method: dpo leaves training.dpo out); None for SFT."""
    if training.method != "dpo":
        return None
    return training.dpo if training.dpo is not None else DpoSpec()
