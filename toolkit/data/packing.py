"""Tokenised records -> fixed-length rows (`Examples`): the long-record policy, then packing.

Records longer than `seq_length + 1` tokens: a text document is split into consecutive pieces of `seq_length + 1`
tokens, each piece its own document (a last piece of one token has no label and is dropped); the documents split
are counted in `Examples.num_split`. A prompt/completion or chat record is cut at the right (its tail would have no
prompt) and counted in `Examples.num_truncated`. Records whose every label is masked (a prompt longer than the
sequence, a chat with no assistant turn) are dropped and counted in `Examples.num_dropped`: they would only add
zero-loss rows.

Rows (`DataSpec.packing`):
* packing=true (default): whole records, in record order, fill each row greedily; a record that does not fit in
  what is left of the row starts the next one. Each record attends only to itself and its positions restart at 0
  (`position_ids`; a 0 after column 0 is a record boundary, which the model turns into a block-diagonal causal
  mask, toolkit/adapters/packed.py). The label that would cross from one record into the next is masked, so a
  record contributes exactly the labels a forward of that record alone has. The rest of a row is padding
  (`pad_token_id`, EOS when the tokenizer has none): loss 0, its own segment with positions from 0.
* packing=false: one record per row, padded; positions run 0 .. seq_length - 1 (the padding follows the record
  under causal attention, which cannot change the record's logits, and the row needs no mask).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from toolkit.data.examples import Examples
from toolkit.errors import DsmtError


def pack_examples(*, ids, targets, kind: str, seq_length: int, pad: int, packed: bool,
                  used_chat_template: bool | None = None) -> Examples:
    """`Examples` of `seq_length + 1` ids from each record's `ids` and `targets` (`targets[t]`: token t is a
    counted label of token t - 1; `targets[0]` never counts); see the module docstring."""
    pieces, counters = fit_records(ids, targets, kind=kind, example_length=seq_length + 1)
    if not pieces:
        raise NoLossTokensError.of_records(ids=ids, targets=targets, kind=kind, seq_length=seq_length)
    rows = pack_rows(pieces, example_length=seq_length + 1) if packed else [[piece] for piece in pieces]
    token_ids, loss_mask, position_ids = row_arrays(rows, pad=pad, example_length=seq_length + 1, packed=packed)
    return Examples(token_ids=token_ids, loss_mask=loss_mask, position_ids=position_ids, kind=kind,
                    used_chat_template=used_chat_template, num_dropped=len(ids) - counters["kept"],
                    num_truncated=counters["truncated"], num_records=len(pieces), num_split=counters["split"])


class NoLossTokensError(DsmtError):
    """No record keeps a loss-bearing label within `seq_length + 1` tokens: the rule every rank applies (above) and
    `dsmt train --dry-run` applies to the records it tokenises, so both say the same line."""

    rule = "no_loss_tokens"

    def __init__(self, message: str, *, fix: str):
        super().__init__(f"[{self.rule}] {message}; fix: {fix}")
        self.detail, self.fix = message, fix

    def __reduce__(self):  # keyword-only __init__: pickle (worker processes) through the keywords
        return functools.partial(NoLossTokensError, self.detail, fix=self.fix), ()

    @classmethod
    def of_records(cls, *, ids, targets, kind: str, seq_length: int) -> "NoLossTokensError":
        """The error for records none of which trains, naming their prompt lengths and the seq_length that fits.
        A record's first label at token t needs t <= seq_length (a row holds tokens 0 .. seq_length)."""
        firsts = [next((t for t in range(1, len(target)) if target[t]), None) for target in targets]
        starts = [t for t in firsts if t is not None]
        what = {"prompt_completion": "prompts", "chat": "turns before the first assistant reply"}.get(kind, "texts")
        message = (f"none of the {len(ids)} {kind} records has a loss-bearing token within seq_length + 1 = "
                   f"{seq_length + 1} tokens")
        if starts:
            lengths = f"{min(starts)}" if min(starts) == max(starts) else f"{min(starts)} to {max(starts)}"
            message += f": their {what} are {lengths} tokens long"
        if len(starts) < len(firsts):
            message += f" ({len(firsts) - len(starts)} records have no loss-bearing token at any length)"
        if not starts:
            return cls(message, fix={"text": "give documents of at least one token (each is ended by EOS)",
                                     "chat": "give conversations with an assistant turn"}.get(kind, "fix the records"))
        whole = max(len(record) - 1 for record, first in zip(ids, firsts) if first is not None)
        return cls(message, fix=f"raise training.seq_length to {whole} (every record whole; at least "
                   f"{min(starts)} trains the shortest prompt's first token), or shorten the prompts")


def fit_records(all_ids, all_targets, *, kind: str, example_length: int) -> tuple[list, dict]:
    """Each record as `(ids, target)` pieces of at most `example_length` tokens by the long-record policy of the
    module docstring; pieces without a loss-bearing label are left out."""
    pieces, kept, truncated, split = [], 0, 0, 0
    for ids, target in zip(all_ids, all_targets):
        if len(ids) > example_length and kind == "text":
            split += 1
            parts = [(ids[i:i + example_length], target[i:i + example_length])
                     for i in range(0, len(ids), example_length)]
        else:
            truncated += len(ids) > example_length
            parts = [(ids[:example_length], target[:example_length])]
        parts = [(list(i), list(t)) for i, t in parts if any(t[1:])]
        kept += bool(parts)
        pieces += parts
    return pieces, {"kept": kept, "truncated": truncated, "split": split}


def pack_rows(pieces: list, *, example_length: int) -> list[list]:
    """Greedy packing in record order: a piece goes into the current row if it fits in what is left, else it
    starts the next row. Every piece is at most `example_length` long."""
    rows, row, used = [], [], 0
    for piece in pieces:
        if row and used + len(piece[0]) > example_length:
            rows.append(row)
            row, used = [], 0
        row.append(piece)
        used += len(piece[0])
    if row:
        rows.append(row)
    return rows


def row_arrays(rows: list[list], *, pad: int, example_length: int, packed: bool):
    """(token_ids [N, L] int64, loss_mask [N, L-1] float32, position_ids [N, L-1] int32) for rows of pieces; the
    label from a piece's last token to the next piece's first is masked, the padding is its own segment when
    `packed` (else its positions continue the record's)."""
    token_ids = np.full((len(rows), example_length), pad, dtype=np.int64)
    targets = np.zeros((len(rows), example_length), dtype=np.float32)
    positions = np.zeros((len(rows), example_length), dtype=np.int32)
    for r, row in enumerate(rows):
        start = 0
        for ids, target in row:
            end = start + len(ids)
            token_ids[r, start:end] = ids
            targets[r, start + 1:end] = target[1:]  # target[0] would be the crossing label: never counted
            positions[r, start:end] = np.arange(len(ids))
            start = end
        positions[r, start:] = np.arange(example_length - start) + (0 if packed else start)
    return (torch.from_numpy(token_ids), torch.from_numpy(targets[:, 1:].copy()),
            torch.from_numpy(positions[:, :-1].copy()))
