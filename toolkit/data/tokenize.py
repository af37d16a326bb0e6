"""Raw records -> fixed-length examples, with the checkpoint's own tokenizer.

Every example is `seq_length + 1` token ids; the model reads `ids[:-1]` at `position_ids` and predicts
`labels = ids[1:]`, and `loss_mask[t]` says whether `labels[t]` counts. Three record kinds (chosen by `DataSpec`):

* text (`text_field`): each document is tokenised as the tokenizer does by default (BOS if it adds one), followed
  by EOS (a tokenizer that already ends it with EOS gets no second one). Every label inside the document counts,
  its EOS included: a document of L tokens has L - 1 labels. With the dsmt tiny tokenizer (no BOS) document `ab`
  is `a b EOS`.
* prompt/completion (`prompt_field` + `completion_field`): `prompt (tokenizer's default specials) + completion +
  EOS`. Labels count on the completion and its EOS only. No chat template: the fields are raw text.
* chat (`messages_field`, a list of `{"role", "content"}`): rendered with `tokenizer.apply_chat_template` when the
  tokenizer has a `chat_template`, else with the fallback `"<role>: <content>\n"` per message and EOS after a
  final assistant turn (`Examples.used_chat_template` and a log line say which). Labels count on each assistant
  turn: the text between the prompt rendered with `add_generation_prompt=True` and the conversation rendered up to
  and including that turn, so the template's end-of-turn marker is learned as well.

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

import logging
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

log = logging.getLogger(__name__)

MAP_BATCH_SIZE = 1000  # records per tokenizer call: big enough for the Rust tokenizer's batching to pay off


@dataclass(frozen=True)
class Examples:
    """Fixed-length examples: `token_ids [N, seq_length + 1]` int64 and `loss_mask [N, seq_length]` float32,
    aligned with `labels = token_ids[:, 1:]`; `position_ids [N, seq_length]` of the inputs `token_ids[:, :-1]`
    (None: 0 .. seq_length - 1 in every row)."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    kind: str  # "text", "prompt_completion", "chat" or "synthetic"
    used_chat_template: bool | None = None  # chat only: False means the "<role>: content" fallback was used
    num_dropped: int = 0  # records left with no loss-bearing label (see the module docstring)
    num_truncated: int = 0  # prompt/completion and chat records cut at seq_length + 1
    position_ids: torch.Tensor | None = None  # restarting at 0 at each packed record (see the module docstring)
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

    def describe(self) -> str:
        """One line for the start-up log: rows, records, and what the long-record policy did."""
        counters = [f"{self.num_records} records" if self.num_records else None,
                    f"{self.num_split} documents split into pieces of seq_length + 1" if self.num_split else None,
                    f"{self.num_truncated} records truncated" if self.num_truncated else None,
                    f"{self.num_dropped} records dropped (no loss-bearing label)" if self.num_dropped else None]
        return f"{len(self)} {self.kind} rows of {self.seq_length + 1} ids" + "".join(
            f", {c}" for c in counters if c)


def record_kind(*, data: DataSpec) -> str:
    if data.messages_field is not None:
        return "chat"
    return "prompt_completion" if data.prompt_field is not None else "text"


def load_tokenizer(*, data: DataSpec, model_path: str | None):
    """The tokenizer at `data.tokenizer`, else the checkpoint's own at `model_path`."""
    from transformers import AutoTokenizer

    where = data.tokenizer or model_path
    if where is None:
        raise DsmtError("no tokenizer: set data.tokenizer or model.path (a checkpoint directory with tokenizer files)")
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as err:
        raise DsmtError(f"could not load a tokenizer from {where!r} ({err}); set data.tokenizer to a directory "
                        f"holding tokenizer.json / tokenizer_config.json") from err


def tokenize_examples(*, records, data: DataSpec, tokenizer, seq_length: int) -> Examples:
    """Tokenise `records` (from `load_records`) into `Examples` of `seq_length + 1` ids; see the module docstring."""
    if seq_length < 1:
        raise DsmtError(f"seq_length={seq_length} must be at least 1")
    if tokenizer.eos_token_id is None:
        raise DsmtError("the tokenizer has no eos_token; documents and completions are terminated with EOS, so set "
                        "eos_token in its tokenizer_config.json")
    kind = record_kind(data=data)
    used_template = None
    if kind == "text":
        encode = _text_encoder(field=data.text_field, tokenizer=tokenizer)
    elif kind == "prompt_completion":
        encode = _prompt_completion_encoder(data=data, tokenizer=tokenizer)
    else:
        used_template = bool(getattr(tokenizer, "chat_template", None))
        if not used_template:
            log.warning("tokenizer has no chat_template: rendering chat records as '<role>: <content>\\n' lines")
        encode = _chat_encoder(field=data.messages_field, tokenizer=tokenizer, use_template=used_template)
    mapped = _map(records, encode=encode, desc=f"tokenize-{kind}")
    pieces, counters = _fit_records(mapped["ids"], mapped["target"], kind=kind, example_length=seq_length + 1)
    if not pieces:
        raise DsmtError(f"none of the {len(records)} {kind} records has a loss-bearing token within seq_length + 1 = "
                        f"{seq_length + 1} tokens; raise training.seq_length or shorten the prompts")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = pack_rows(pieces, example_length=seq_length + 1) if data.packing else [[piece] for piece in pieces]
    token_ids, loss_mask, position_ids = _row_arrays(rows, pad=pad, example_length=seq_length + 1,
                                                     packed=data.packing)
    examples = Examples(token_ids=token_ids, loss_mask=loss_mask, position_ids=position_ids, kind=kind,
                        used_chat_template=used_template, num_dropped=len(records) - counters["kept"],
                        num_truncated=counters["truncated"], num_records=len(pieces), num_split=counters["split"])
    log.info("data: %s (data.packing=%s)", examples.describe(), data.packing)
    return examples


def _fit_records(all_ids, all_targets, *, kind: str, example_length: int) -> tuple[list, dict]:
    """Each record as `(ids, target)` pieces of at most `example_length` tokens by the long-record policy of the
    module docstring; pieces without a loss-bearing label are left out. `target[t]` says whether token t is a
    label (of token t - 1): `target[0]` never counts."""
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


def _row_arrays(rows: list[list], *, pad: int, example_length: int, packed: bool):
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


def _check_strings(values, *, field: str, offset: int) -> None:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise DsmtError(f"record {offset + i}: field {field!r} is {type(value).__name__} ({value!r:.60}), "
                            f"expected a string; clean the record or pick another field")


def _map(records, *, encode, desc: str):
    """`datasets.map` in batches, in memory and without the on-disk cache: the output depends on the tokenizer,
    which `datasets` cannot fingerprint reliably, and a stale cache would silently reuse old ids."""
    return records.map(encode, batched=True, batch_size=MAP_BATCH_SIZE, with_indices=True,
                       remove_columns=records.column_names, keep_in_memory=True, load_from_cache_file=False,
                       new_fingerprint=f"dsmt-{desc}-{records._fingerprint}", desc=desc)


def _text_encoder(*, field: str, tokenizer):
    eos = tokenizer.eos_token_id

    def encode(batch, indices):
        _check_strings(batch[field], field=field, offset=indices[0])
        ids = tokenizer(batch[field])["input_ids"]
        # EOS ends every document; a tokenizer that appends EOS itself must not get a second one.
        ids = [doc if doc and doc[-1] == eos else doc + [eos] for doc in ids]
        return {"ids": ids, "target": [[1] * len(doc) for doc in ids]}

    return encode


def _prompt_completion_encoder(*, data: DataSpec, tokenizer):
    prompt_field, completion_field, eos = data.prompt_field, data.completion_field, tokenizer.eos_token_id

    def encode(batch, indices):
        _check_strings(batch[prompt_field], field=prompt_field, offset=indices[0])
        _check_strings(batch[completion_field], field=completion_field, offset=indices[0])
        prompts = tokenizer(batch[prompt_field])["input_ids"]  # BOS etc. as the tokenizer adds them at inference
        completions = tokenizer(batch[completion_field], add_special_tokens=False)["input_ids"]
        return {"ids": [p + c + [eos] for p, c in zip(prompts, completions)],
                "target": [[0] * len(p) + [1] * (len(c) + 1) for p, c in zip(prompts, completions)]}

    return encode


def _render(*, tokenizer, messages, add_generation_prompt: bool, use_template: bool) -> str:
    if use_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def _check_messages(messages, *, field: str, index: int) -> list[dict]:
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok or not messages:
        raise DsmtError(f"record {index}: field {field!r} must be a non-empty list of {{'role': str, 'content': str}} "
                        f"messages; got {messages!r:.120}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]  # json loading adds None-valued keys


def assistant_spans(*, tokenizer, messages, use_template: bool, index: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans `[start, end)` of its assistant turns."""
    full = _render(tokenizer=tokenizer, messages=messages, add_generation_prompt=False, use_template=use_template)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer=tokenizer, messages=messages[:turn], add_generation_prompt=True,
                         use_template=use_template)
        through = _render(tokenizer=tokenizer, messages=messages[: turn + 1], add_generation_prompt=False,
                          use_template=use_template)
        # Templates that rewrite earlier turns (e.g. dropping past reasoning) have no stable prefix to mask.
        if not (full.startswith(through) and through.startswith(before)):
            raise DsmtError(f"record {index}: the chat template renders turn {turn} differently once later turns "
                            f"follow, so the assistant tokens cannot be located; use a template whose renderings "
                            f"are prefixes of each other, or pre-render the chats into prompt/completion fields")
        spans.append((len(before), len(through)))
    return full, spans


def _chat_encoder(*, field: str, tokenizer, use_template: bool):
    eos = tokenizer.eos_token_id

    def encode(batch, indices):
        texts, all_spans, ends_with_assistant = [], [], []
        for index, raw in zip(indices, batch[field]):
            messages = _check_messages(raw, field=field, index=index)
            text, spans = assistant_spans(tokenizer=tokenizer, messages=messages, use_template=use_template,
                                          index=index)
            texts.append(text)
            all_spans.append(spans)
            ends_with_assistant.append(messages[-1]["role"] == "assistant")
        # The template writes BOS and turn markers itself; offsets map each token back to the rendered text.
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        ids_out, target_out = [], []
        for ids, offsets, spans, final in zip(encoded["input_ids"], encoded["offset_mapping"], all_spans,
                                              ends_with_assistant):
            target = [int(any(s <= start < e for s, e in spans) and end > start) for start, end in offsets]
            if not use_template:  # the fallback has no end-of-turn marker: EOS teaches the model to stop
                ids, target = ids + [eos], target + [int(final)]
            ids_out.append(list(ids))
            target_out.append(target)
        return {"ids": ids_out, "target": target_out}

    return encode
