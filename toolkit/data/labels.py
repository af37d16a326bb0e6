"""What text and image tasks share (toolkit/data/tasks.py, toolkit/data/images.py): the interface of a task's
examples (`TaskExamples`) and the rules for classification labels (class names, ids in range) with their errors."""

from __future__ import annotations

import torch

from toolkit.errors import DsmtError


class LabelFieldMissingError(DsmtError):
    """A classification record has no `data.label_field` value."""

    rule = "label_field"  # the `dsmt check` rule name


class LabelTypeError(DsmtError):
    """A label value is not what the head takes (class id, label name, or a number for regression)."""

    rule = "label_type"  # the `dsmt check` rule name


class NumLabelsMismatchError(DsmtError):
    """The labels in the data do not fit the model's `num_labels`."""

    rule = "num_labels"  # the `dsmt check` rule name


class TaskExamples:
    """N examples of one task; `batch` collates rows by example index and global sample position."""

    task: str

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, *, indices: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `indices` (example indices) as model inputs; `positions` (their global sample positions g) seed
        whatever is random per sample (masked-LM masks)."""
        raise NotImplementedError


def named_labels(model_config) -> dict[str, int] | None:
    """config.label2id when it names the classes; None for HF's default names LABEL_0, LABEL_1, ..."""
    label2id = dict(getattr(model_config, "label2id", None) or {})
    if not label2id or all(name == f"LABEL_{i}" for name, i in label2id.items()):
        return None
    return {str(name): int(i) for name, i in label2id.items()}


def check_num_labels(*, label_ids: list[int], num_labels: int, what: str) -> None:
    found = sorted(set(label_ids))
    if found and (found[0] < 0 or found[-1] >= num_labels):
        shown = ", ".join(map(str, found[:20])) + (", ..." if len(found) > 20 else "")
        raise NumLabelsMismatchError(
            f"the labels in {what} are {{{shown}}} but the model has num_labels={num_labels} (class ids 0 .. "
            f"{num_labels - 1}); re-save the model with num_labels={max(found[-1] + 1, num_labels)} "
            f"(e.g. from_pretrained(..., num_labels=N)) or fix the labels")
