"""DPO (`training.method: dpo`, toolkit/spec/preference.py) in the planner: what a preference step adds to an SFT one.

What the plan counts (toolkit/train/engine/preference.py and hybrid.py run it so):
  micro-batch    micro_batch_size counts PAIRS. data.packing true (the default): one row of seq_length per pair,
                 chosen then rejected; false: two rows of seq_length per pair. Activations and FLOPs are counted
                 for those rows, every row taken as full (a pair's tokens fill its row at worst).
  reference      a live reference (base, or a checkpoint path) runs one forward of every micro-batch of the step,
                 under no_grad and before the policy's forward-backward (hybrid.py `train_step` adds its log-probs
                 first). `reference: precomputed` reads log-probs stored with the data: no weights, no forward.
  its weights    full fine-tuning: a frozen copy of the weights at the policy's TP x PP (and EP) sharding, in the
                 training dtype, whole on every data-parallel rank (dsmt does not hand it to ZeRO), no gradient, no
                 optimizer state. LoRA with reference base: the policy with its adapters switched off, no copy. LoRA
                 with a checkpoint path: other weights than the policy's base, so counted as a copy like full
                 fine-tuning (the conservative reading; the trainer may refuse that combination).
  its memory     nothing kept for backward. Its transient (one layer's forward working set, and on the last stage
                 the micro-batch's logits with their fp32 upcast) happens while the policy holds no activations
                 (the reference runs first), so a stage's activation figure is the larger of the two, not the sum;
                 with dsmt's counting the policy's is always the larger (its output layer alone holds the logits
                 plus their fp32 gradient), so the term only guards the count.
  its time       one forward per micro-batch, a forward-only pipeline pass of its own (fill and drain included):
                 about a third of the policy's forward + backward, a quarter of its compute under full recompute
                 (which already re-runs each forward). Under ZeRO-3 with LoRA the reference is the partitioned
                 model: its forward gathers the weights again.
"""

from __future__ import annotations

import dataclasses

from toolkit.models.shapes import ModelShape
from toolkit.plan.activations import activation_bytes_per_layer
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layers import padded_vocab_size, stage_layer_kinds



@dataclasses.dataclass(frozen=True, kw_only=True)
class DpoShape:
    """What of `training.dpo` and `data` the plan needs: where the reference comes from and how a pair is laid out."""

    reference: str = "base"    # base | precomputed | a checkpoint path | none (SimPO, ORPO: reference-free)
    packing: bool = True       # data.packing: both sides of a pair in one row (true) or a row each (false)

    @property
    def live_reference(self) -> bool:
        """A reference model runs in the step (base or a path); precomputed log-probs are read from disk."""
        return self.reference not in ("precomputed", "none")

    @property
    def rows_per_pair(self) -> int:
        return 1 if self.packing else 2

    def describe(self) -> str:
        rows = ("both sides in one row of seq_length (data.packing true)" if self.packing
                else "2 rows of seq_length, one per side (data.packing false)")
        return f"reference {self.reference}; micro_batch_size counts pairs, each {rows}"


def dpo_shape_of(spec) -> DpoShape | None:
    """A job spec's DPO as the planner counts it (None for SFT): `toolkit.check.checks.planner_inputs` passes it
    as TrainingShape.dpo."""
    from toolkit.spec.preference import preference_settings

    found = preference_settings(spec.training)
    if found is None:
        return None
    method, settings = found  # SimPO and ORPO: pairs, no reference
    return DpoShape(reference=settings.reference if method == "dpo" else "none", packing=spec.data.packing)


def rows_per_pair(training) -> int:
    """Rows of seq_length per micro-batch element: 1 for SFT and packed DPO, 2 for unpacked DPO."""
    return 1 if training.dpo is None else training.dpo.rows_per_pair


def row_layout(*, layout, training):
    """`layout` with micro_batch_size in rows of seq_length, the unit the activation formulas count."""
    rows = rows_per_pair(training)
    return layout if rows == 1 else dataclasses.replace(layout, micro_batch_size=layout.micro_batch_size * rows)


def live_reference(training) -> bool:
    return training.dpo is not None and training.dpo.live_reference


def holds_reference_copy(training) -> bool:
    """A second set of weights on every GPU: full fine-tuning with a live reference, or LoRA with a reference
    checkpoint path (module docstring). LoRA with reference base switches its adapters off instead."""
    if not live_reference(training):
        return False
    return training.lora is None or training.dpo.reference != "base"


def reference_weight_bytes(*, params_per_gpu: int, training, assumptions: Assumptions) -> int:
    """The frozen reference's weights on one GPU: the policy's parameters of this stage shard (TP x PP, E / ep
    experts) in the training dtype, not partitioned by ZeRO."""
    return params_per_gpu * assumptions.param_bytes if holds_reference_copy(training) else 0


def reference_forward_bytes(*, shape: ModelShape, layout, training, assumptions: Assumptions, stage: int) -> int:
    """The reference forward's transient on one GPU of `stage` (`layout` in rows: row_layout): one layer's
    forward working set (bounded by what that layer stores for backward without recompute: under no_grad each
    tensor is freed once read) and, on the last stage, the micro-batch's vocab-parallel logits in the activation
    dtype and their fp32 upcast in megatron's cross entropy (one tensor in an fp32 run). 0 without a live
    reference."""
    if not live_reference(training):
        return 0
    layer = max(activation_bytes_per_layer(
        shape=shape, seq_length=training.seq_length, micro_batch_size=layout.micro_batch_size, tp=layout.tp,
        sequence_parallel=layout.sp, recompute="none", assumptions=assumptions, cp=layout.cp, ep=layout.ep, moe=moe,
        mixer=mixer) for moe, mixer in stage_layer_kinds(shape=shape, layout=layout, stage=stage))
    if stage != layout.pp - 1:
        return layer
    ab = assumptions.activation_bytes
    tokens = training.seq_length // layout.cp * layout.micro_batch_size
    vocab_rows = padded_vocab_size(shape=shape, tp=layout.tp) // layout.tp
    return layer + tokens * vocab_rows * (ab + 4 if ab < 4 else 4)
