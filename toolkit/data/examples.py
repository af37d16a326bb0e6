"""The rows a training job draws from: `Examples`, fixed-length rows in memory or memory-mapped.

Every row is `seq_length + 1` token ids; the model reads `ids[:-1]` at `position_ids` and predicts
`labels = ids[1:]`, and `loss_mask[t]` says whether `labels[t]` counts. Whatever makes rows (tokenised records:
toolkit/data/packing.py; a Megatron corpus: toolkit/data/indexed.py; a mix: toolkit/data/mix.py) offers the same
three calls the batches need: `len()`, `seq_length`, `rows(indices)` and `counted_tokens()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.errors import DsmtError


@dataclass(frozen=True)
class Examples:
    """Fixed-length examples: `token_ids [N, seq_length + 1]` int64 and `loss_mask [N, seq_length]` float32,
    aligned with `labels = token_ids[:, 1:]`; `position_ids [N, seq_length]` of the inputs `token_ids[:, :-1]`
    (None: 0 .. seq_length - 1 in every row)."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    kind: str  # "text", "prompt_completion", "chat" or "synthetic"
    used_chat_template: bool | None = None  # chat only: False means the "<role>: content" fallback was used
    num_dropped: int = 0  # records left with no loss-bearing label (toolkit/data/packing.py)
    num_truncated: int = 0  # prompt/completion and chat records cut at seq_length + 1
    position_ids: torch.Tensor | None = None  # restarting at 0 at each packed record
    num_records: int = 0  # records (text: documents, or their pieces) placed in the rows
    num_split: int = 0  # text documents longer than seq_length + 1, split into pieces

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.token_ids.shape[1]) - 1

    def positions(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 `[len(rows), seq_length]` position ids of `rows`."""
        if self.position_ids is None:
            return torch.arange(self.seq_length).expand(len(rows), self.seq_length).contiguous()
        return self.position_ids[rows].to(torch.int64)

    def rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_ids int64 `[n, seq_length + 1]`, loss_mask float32 `[n, seq_length]`, position_ids int64
        `[n, seq_length]`) of the row indices `rows`."""
        return self.token_ids[rows], self.loss_mask[rows].to(torch.float32), self.positions(rows)

    def counted_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def max_token_id(self) -> int:
        return int(self.token_ids.max())

    def describe(self) -> str:
        """One line for the start-up log: rows, records, and what the long-record policy did."""
        counters = [f"{self.num_records} records" if self.num_records else None,
                    f"{self.num_split} documents split into pieces of seq_length + 1" if self.num_split else None,
                    f"{self.num_truncated} records truncated" if self.num_truncated else None,
                    f"{self.num_dropped} records dropped (no loss-bearing label)" if self.num_dropped else None]
        return f"{len(self)} {self.kind} rows of {self.seq_length + 1} ids" + "".join(
            f", {c}" for c in counters if c)


def count_loss_tokens(rows, *, chunk_rows: int = 1024) -> int:
    """The counted labels of every row of a row source read through its `rows()`, `chunk_rows` at a time (a
    source that is not one tensor in memory: a Megatron corpus, a mix)."""
    return sum(int(rows.rows(torch.arange(start, min(start + chunk_rows, len(rows))))[1].sum())
               for start in range(0, len(rows), chunk_rows))


def check_vocab(*, largest_id: int, vocab_size: int, tokenizer_ref: str | None) -> None:
    if largest_id >= vocab_size:  # an embedding lookup past the table fails far from here, or silently on GPU
        raise DsmtError(f"token_ids_vocab: the data holds token id {largest_id} but the model's vocab_size is "
                        f"{vocab_size}; use the checkpoint's own tokenizer (data.tokenizer={tokenizer_ref!r})")
