"""Tokenised preference pairs -> fixed-length rows (`PreferenceExamples`): truncation, then the pair's rows.

Rows are `L = seq_length + 1` ids (a row's inputs are `ids[:-1]`, its labels `ids[1:]`). A side `s` of a pair is
`p_s` prompt tokens then `c_s` completion tokens (EOS included); the chosen and rejected prompts are the same text
but may tokenise apart (a chat template renders the whole conversation). The prompt is cut from the LEFT (TRL's
`keep_end`), both sides by one rule, then the completions at the right:

* data.packing=false: each side its own row, chosen then rejected (`rows_per_pair = 2`).
  `kept_s = min(p_s, max(1, L - max(c_chosen, c_rejected)))` (the last `kept_s` prompt tokens), then the completion
  cut to its first `L - kept_s` tokens. Positions run 0 .. L - 2, padding after.
* data.packing=true: both sides in one row (`rows_per_pair = 1`), chosen then rejected, positions restarting at 0
  at the rejected one, padding (its own segment) after; the label crossing from chosen into rejected is not
  counted (toolkit/data/packing.py's packed records). `kept_s = min(p_s, max(1, (L - c_chosen - c_rejected) // 2))`;
  if the pair is still longer than L, `A = L - kept_chosen - kept_rejected`, the shorter completion keeps
  `min(c_short, A // 2)` tokens and the longer one the rest of `A` (the longer is cut first; chosen counts as the
  shorter on a tie).

A pair cut in any way counts in `num_truncated`; a pair where either side keeps no counted label is dropped
(`num_dropped`): its log-ratio would be of nothing. If every pair kept has chosen ids == rejected ids, nothing can
be learned: PreferenceError `preference_identical`. `sequence` says which side each label belongs to (0 chosen,
1 rejected; 0 where not counted).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.data.packing import NoLossTokensError, row_arrays
from toolkit.errors import DsmtError

SIDES = ("chosen", "rejected")  # a pair's sides, in row order
PREFERENCE_KIND = "preference"  # `PreferenceExamples.kind`, and the cache's


class PreferenceError(DsmtError):
    """Preference data that cannot train as the data section says; `rule` names why (as `dsmt check` reports it)."""

    def __init__(self, *, rule: str, message: str, fix: str):
        self.rule, self.detail, self.fix = rule, message, fix
        super().__init__(f"[{rule}] {message}; fix: {fix}")

    def __reduce__(self):  # keyword-only __init__: pickle (worker processes) through the keywords
        return functools.partial(PreferenceError, rule=self.rule, message=self.detail, fix=self.fix), ()


def identical_error(*, num_pairs: int, where: str) -> PreferenceError:
    """Every pair's chosen equals its rejected: the DPO loss is then constant and nothing is learned."""
    return PreferenceError(rule="preference_identical", message=f"all {num_pairs} preference pairs {where} have "
                           f"chosen == rejected, so the DPO loss is the same for every parameter value and nothing "
                           f"is learned", fix="give each record a chosen and a rejected response that differ (were "
                           "both filled from the same column?)")


@dataclass(frozen=True)
class PreferenceExamples:
    """N pairs in `N * rows_per_pair` rows; pair `i` is rows `i * R .. i * R + R - 1`. `token_ids [N*R, L]` int64,
    `loss_mask [N*R, L-1]` float32, `position_ids [N*R, L-1]` int32, `sequence [N*R, L-1]` int8 (the side of
    `labels[t]`: 0 chosen, 1 rejected, 0 where not counted)."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    sequence: torch.Tensor
    rows_per_pair: int  # 1: packed (chosen then rejected in one row); 2: a row per side
    kind: str = PREFERENCE_KIND
    used_chat_template: bool | None = None  # message records only: False means the "<role>: content" fallback
    num_dropped: int = 0  # pairs where a side keeps no counted label
    num_truncated: int = 0  # pairs cut to fit L
    num_records: int = 0  # pairs kept
    directory: Path | None = None  # the cache directory the arrays were opened from (toolkit/data/cache.py)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0]) // self.rows_per_pair

    @property
    def seq_length(self) -> int:
        return int(self.token_ids.shape[1]) - 1

    def pair_rows(self, indices) -> dict[str, torch.Tensor]:
        """The micro-batch of the pairs `indices` (n of them, R rows each, pair-major): `tokens`, `labels`,
        `position_ids`, `sequence_index` (2 * j + side for pair j of the batch, 0 where not counted) int64 and
        `loss_mask` float32, each `[n * R, seq_length]`; `pair_mask` float32 (ones) and `pair_index` int64
        (`indices`), each `[n]`."""
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        rows = (indices[:, None] * self.rows_per_pair + torch.arange(self.rows_per_pair)).reshape(-1)
        ids = self.token_ids[rows]
        loss_mask = self.loss_mask[rows].to(torch.float32)
        pair_in_batch = torch.arange(len(indices)).repeat_interleave(self.rows_per_pair)[:, None]
        sequence_index = (2 * pair_in_batch + self.sequence[rows].to(torch.int64)) * (loss_mask > 0)
        return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(), "loss_mask": loss_mask,
                "position_ids": self.position_ids[rows].to(torch.int64), "sequence_index": sequence_index,
                "pair_mask": torch.ones(len(indices), dtype=torch.float32), "pair_index": indices.clone()}

    def counted_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def max_token_id(self) -> int:
        return int(self.token_ids.max())

    def describe(self) -> str:
        """One line for the start-up log: pairs, rows, and what the long-pair policy did."""
        layout = "chosen then rejected in one row" if self.rows_per_pair == 1 else "a row per side"
        counters = [f"{self.num_truncated} pairs truncated" if self.num_truncated else None,
                    f"{self.num_dropped} pairs dropped (a side without a loss-bearing label)"
                    if self.num_dropped else None]
        return (f"{len(self)} preference pairs ({layout}) in {self.token_ids.shape[0]} rows of {self.seq_length + 1} "
                f"ids" + "".join(f", {c}" for c in counters if c))


def pair_examples(*, mapped, seq_length: int, pad: int, packed: bool,
                  used_chat_template: bool | None) -> PreferenceExamples:
    """`PreferenceExamples` from the tokenised pairs `mapped` (columns `{side}_ids`, `{side}_target`,
    `{side}_prompt` of toolkit/data/preference.py; `target[t]`: token t is a counted label of token t - 1)."""
    length = seq_length + 1
    columns = {f"{side}_{what}": mapped[f"{side}_{what}"] for side in SIDES for what in ("ids", "target", "prompt")}
    pairs, num_truncated = [], 0
    # one pass over the columns together (indexing a `datasets` column row by row costs ~40 us a read)
    for c_ids, c_target, c_prompt, r_ids, r_target, r_prompt in zip(*columns.values()):
        sides = [(c_ids, c_target, c_prompt), (r_ids, r_target, r_prompt)]
        pieces, truncated = fit_pair(sides, example_length=length, packed=packed)
        if all(any(target[1:]) for _, target in pieces):  # target[0] is never a label
            pairs.append(pieces)
            num_truncated += truncated
    num_pairs = len(columns["chosen_ids"])
    if not pairs:
        raise _no_pairs_error(columns=columns, num_pairs=num_pairs, length=length, packed=packed)
    if all(chosen[0] == rejected[0] for chosen, rejected in pairs):
        raise identical_error(num_pairs=len(pairs), where=f"kept within seq_length + 1 = {length} tokens")
    rows = [[chosen, rejected] for chosen, rejected in pairs] if packed else [
        [piece] for pair in pairs for piece in pair]
    token_ids, loss_mask, position_ids = row_arrays(rows, pad=pad, example_length=length, packed=packed)
    sequence = _sides_of_labels(pairs, loss_mask=loss_mask, packed=packed)
    return PreferenceExamples(token_ids=token_ids, loss_mask=loss_mask, position_ids=position_ids, sequence=sequence,
                              rows_per_pair=1 if packed else 2, used_chat_template=used_chat_template,
                              num_dropped=num_pairs - len(pairs), num_truncated=num_truncated, num_records=len(pairs))


def fit_pair(sides, *, example_length: int, packed: bool) -> tuple[list[tuple[list, list]], bool]:
    """((ids, target) of chosen, of rejected) cut by the module docstring's rule, and whether anything was cut.
    `sides`: (ids, target, prompt tokens) of chosen, then of rejected."""
    prompts = [prompt for _, _, prompt in sides]
    completions = [len(ids) - prompt for ids, _, prompt in sides]
    if packed:
        kept = [min(p, max(1, (example_length - sum(completions)) // 2)) for p in prompts]
        lengths = list(completions)
        if sum(kept) + sum(completions) > example_length:
            room = example_length - sum(kept)
            short = 0 if completions[0] <= completions[1] else 1
            lengths[short] = min(completions[short], room // 2)
            lengths[1 - short] = min(completions[1 - short], room - lengths[short])
    else:
        kept = [min(p, max(1, example_length - max(completions))) for p in prompts]
        lengths = [min(c, example_length - k) for c, k in zip(completions, kept)]
    pieces = [(list(ids[p - k:p + n]), list(target[p - k:p + n]))
              for (ids, target, p), k, n in zip(sides, kept, lengths)]
    return pieces, kept != prompts or lengths != completions


def _sides_of_labels(pairs, *, loss_mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """int8 `[rows, L-1]`: 1 where `labels[t]` is a counted label of the rejected side, else 0."""
    counted = loss_mask.numpy() > 0
    if packed:  # labels[t] = ids[t + 1] is rejected's from the first rejected token on
        starts = np.array([len(chosen[0]) for chosen, _ in pairs])[:, None]
        rejected = np.arange(counted.shape[1])[None, :] + 1 >= starts
    else:  # odd rows are the rejected sides
        rejected = (np.arange(counted.shape[0]) % 2 == 1)[:, None]
    return torch.from_numpy((counted & rejected).astype(np.int8))


def _no_pairs_error(*, columns: dict, num_pairs: int, length: int, packed: bool) -> NoLossTokensError:
    """No pair keeps a counted label on both sides: the seq_length that holds the longest trainable pair whole, or
    (none trains at any length) what the completions lack."""
    message = (f"none of the {num_pairs} preference pairs keeps a loss-bearing token on both sides within "
               f"seq_length + 1 = {length} tokens")
    whole = [(len(c) + len(r)) if packed else max(len(c), len(r))
             for c, r, c_target, r_target in zip(columns["chosen_ids"], columns["rejected_ids"],
                                                 columns["chosen_target"], columns["rejected_target"])
             if any(c_target[1:]) and any(r_target[1:])]
    if not whole:
        return NoLossTokensError(message + " at any length", fix="give every side a completion to learn (a message "
                                 "completion needs an assistant turn)")
    return NoLossTokensError(message, fix=f"raise training.seq_length to {max(whole) - 1} (every pair whole), or "
                             f"shorten the prompts and completions")
