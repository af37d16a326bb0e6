"""DPO micro-batches a user's script brings (`run.train_step` when the spec says `training.method: dpo`): n pairs
in the Hugging Face convention of each side, turned into dsmt's rows of pairs (toolkit/train/engine/preference.py).

    chosen_input_ids, rejected_input_ids   [micro_batch_size, seq_length] token ids (prompt + completion)
    chosen_labels, rejected_labels         the same shape; -100 on the prompt and the padding (TRL's
                                           completion-only labels), HF-shifted inside as for SFT
    chosen_attention_mask, ...             optional, 1 for tokens, 0 for right padding
    ref_chosen_logps, ref_rejected_logps   [micro_batch_size] precomputed reference log-probs, each the SUM over
                                           the completion's tokens (TRL 1.x's columns; TRL 0.x's IPO divided them
                                           by the length: not these): required when training.dpo.reference is
                                           precomputed, refused otherwise (the run then computes them itself)

micro_batch_size counts pairs, as in the spec. The sides are interleaved into 2n rows (chosen of pair j in row 2j,
rejected in row 2j + 1) and checked by the SFT rules (toolkit/train/engine/hf_batches.py) on that 2n x seq_length
batch, so a bad pair is named as every other bad micro-batch is, on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from toolkit.data.preference_rows import SIDES
from toolkit.train.engine import hf_batches
from toolkit.train.engine.preference import REFERENCE_KEY

REQUIRED = tuple(f"{side}_{name}" for side in SIDES for name in ("input_ids", "labels"))
OPTIONAL = ("chosen_attention_mask", "rejected_attention_mask", "ref_chosen_logps", "ref_rejected_logps")


def pair_reader(*, reference: str):
    """The `read` of `hf_batches.take_micro_batches` for pairs; `reference`: "live" (the run computes the reference
    log-probs), "precomputed" (the micro-batches bring them) or "none" (SimPO, ORPO: reference-free)."""
    def read(batch, *, index: int, rules: hf_batches.BatchRules):
        problems = _pair_problems(batch, index=index, reference=reference)
        problems += _reference_problems(batch, index=index, pairs=rules.micro_batch_size) if not problems else []
        if problems:
            return None, problems
        rows_rules = dataclasses.replace(rules, micro_batch_size=2 * rules.micro_batch_size)
        interleaved = {name: _interleave(batch[f"chosen_{name}"], batch[f"rejected_{name}"])
                       for name in ("input_ids", "labels", "attention_mask") if f"chosen_{name}" in batch}
        row, problems = hf_batches.read_micro_batch(interleaved, index=index, rules=rows_rules)
        if row is None:  # said of the 2n interleaved rows: name the sides' own shape too
            return None, [f"{problem} (a DPO micro-batch: chosen_* and rejected_* each [micro_batch_size = "
                          f"{rules.micro_batch_size} pairs, seq_length = {rules.seq_length}], checked as their "
                          f"{2 * rules.micro_batch_size} interleaved rows)" for problem in problems]
        row = _with_pairs(row, batch=batch)
        empty = (row["loss_mask"].sum(1) == 0).nonzero().flatten().tolist()
        if empty:  # its log-prob would be 0: the data path drops such pairs
            return None, [f"micro_batch_labels: micro-batch {index}, pair {row_index // 2}: the "
                          f"{SIDES[row_index % 2]} side has no label other than -100 (after HF's shift), so it has "
                          "no completion to score; give each side its completion's labels, or leave the pair out"
                          for row_index in empty[:3]]
        return row, []

    return read


def _pair_problems(batch, *, index: int, reference: str) -> list[str]:
    where = f"micro-batch {index}"
    if not hasattr(batch, "keys"):
        return [f"micro_batch_type: {where} is a {type(batch).__name__}, not a mapping of tensors (chosen_input_ids, "
                "chosen_labels, rejected_input_ids, rejected_labels)"]
    keys = set(batch.keys())
    problems = [f"micro_batch_keys: {where} lacks {name!r} (training.method is dpo: pairs of chosen and rejected "
                "sequences)" for name in REQUIRED if name not in keys]
    unknown = sorted(str(key) for key in keys - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        problems.append(f"micro_batch_keys: {where} has keys {unknown} dsmt does not read; a DPO micro-batch has "
                        f"{list(REQUIRED + OPTIONAL)}")
    if ("chosen_attention_mask" in keys) != ("rejected_attention_mask" in keys):
        problems.append(f"micro_batch_keys: {where} has an attention mask for one side only; give both or neither")
    given = [name for name in ("ref_chosen_logps", "ref_rejected_logps") if name in keys]
    if reference == "none" and given:
        problems.append(f"micro_batch_keys: {where} has {', '.join(given)}, but training.method is reference-free "
                        "(simpo, orpo); drop them")
    elif reference == "precomputed" and len(given) < 2:
        problems.append(f"micro_batch_keys: {where} lacks ref_chosen_logps / ref_rejected_logps, and "
                        "training.dpo.reference is precomputed (the run holds no reference model); add them, or "
                        "set training.dpo.reference: base")
    elif given and reference == "live":  # one rule per run: the ranks of a replica decide alike
        problems.append(f"micro_batch_keys: {where} has {', '.join(given)}, but this run computes the reference "
                        "log-probs itself (training.dpo.reference is base or a path); drop them, or set "
                        "training.dpo.reference: precomputed")
    return problems


def _reference_problems(batch, *, index: int, pairs: int) -> list[str]:
    """Precomputed reference log-probs: one finite float per pair and side (a [n] tensor would otherwise broadcast
    one pair's value to all, or fail on the last stage alone)."""
    problems = []
    for name in ("ref_chosen_logps", "ref_rejected_logps"):
        if name not in batch:
            continue
        value = batch[name]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != pairs:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            problems.append(f"micro_batch_reference: micro-batch {index}: {name} is {shape}, expected a float "
                            f"tensor of micro_batch_size = {pairs} values (a log-prob sum per pair)")
        elif not torch.isfinite(value).all():
            problems.append(f"micro_batch_reference: micro-batch {index}: {name} holds non-finite values")
    return problems


def _interleave(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    if not (isinstance(chosen, torch.Tensor) and isinstance(rejected, torch.Tensor)) or chosen.shape != rejected.shape:
        return chosen  # the row check names the wrong type or shape
    return torch.stack([chosen, rejected], dim=1).reshape(2 * chosen.shape[0], *chosen.shape[1:])


def _with_pairs(row: dict, *, batch) -> dict:
    rows, length = row["tokens"].shape
    pairs = rows // 2
    row["sequence_index"] = torch.arange(rows, device=row["tokens"].device)[:, None].expand(rows, length).contiguous()
    row["pair_mask"] = torch.ones(pairs, device=row["tokens"].device)
    if "ref_chosen_logps" in batch:
        row[REFERENCE_KEY] = _interleave(torch.as_tensor(batch["ref_chosen_logps"]).float().reshape(-1),
                                         torch.as_tensor(batch["ref_rejected_logps"]).float().reshape(-1))
    return row


def padding_pairs(rules: hf_batches.BatchRules) -> dict[str, torch.Tensor]:
    """Pairs that add nothing to a loss (pair_mask 0, no counted label): what evaluation pads a short rank with."""
    rows = hf_batches.padding_rows(dataclasses.replace(rules, micro_batch_size=2 * rules.micro_batch_size))
    rows["sequence_index"] = torch.zeros_like(rows["tokens"])
    rows["pair_mask"] = torch.zeros(rules.micro_batch_size)
    rows[REFERENCE_KEY] = torch.zeros(2 * rules.micro_batch_size)
    return rows
