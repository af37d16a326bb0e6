"""Raw records -> fixed-length examples, with the checkpoint's own tokenizer.

Every example is `seq_length + 1` token ids; the model reads `ids[:-1]` and predicts `labels = ids[1:]`, and
`loss_mask[t]` says whether `labels[t]` counts. Three record kinds (chosen by `DataSpec`):

* text (`text_field`): each document is tokenised as the tokenizer does by default (BOS if it adds one), followed
  by EOS; all documents are concatenated in record order and cut into chunks of `seq_length + 1`; the remainder is
  dropped. Every label counts, the EOS and the first token of the next document included. With the dsmt tiny
  tokenizer (no BOS) documents `d0, d1` give the stream `d0 EOS d1 EOS`.
* prompt/completion (`prompt_field` + `completion_field`): `prompt (tokenizer's default specials) + completion +
  EOS`, one example per record, cut at the right or padded to `seq_length + 1` with `pad_token_id` (EOS when the
  tokenizer has none). Labels count on the completion and its EOS only. No chat template: the fields are raw text.
* chat (`messages_field`, a list of `{"role", "content"}`): rendered with `tokenizer.apply_chat_template` when the
  tokenizer has a `chat_template`, else with the fallback `"<role>: <content>\n"` per message and EOS after a
  final assistant turn (`Examples.used_chat_template` and a log line say which). Labels count on each assistant
  turn: the text between the prompt rendered with `add_generation_prompt=True` and the conversation rendered up to
  and including that turn, so the template's end-of-turn marker is learned as well.

Records whose every label is masked (a prompt longer than the sequence, a chat with no assistant turn) are
dropped and counted in `Examples.num_dropped`, since they would only add zero-loss rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

log = logging.getLogger(__name__)

MAP_BATCH_SIZE = 1000  # records per tokenizer call: big enough for the Rust tokenizer's batching to pay off


@dataclass(frozen=True)
class Examples:
    """Fixed-length examples: `token_ids [N, seq_length + 1]` int64 and `loss_mask [N, seq_length]` float32,
    aligned with `labels = token_ids[:, 1:]`."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    kind: str  # "text", "prompt_completion", "chat" or "synthetic"
    used_chat_template: bool | None = None  # chat only: False means the "<role>: content" fallback was used
    num_dropped: int = 0  # records left with no loss-bearing label (see the module docstring)
    num_truncated: int = 0  # prompt/completion and chat records cut at seq_length + 1

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.token_ids.shape[1]) - 1


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
    if kind == "text":
        return _pack_text(records=records, field=data.text_field, tokenizer=tokenizer, seq_length=seq_length)
    if kind == "prompt_completion":
        encode = _prompt_completion_encoder(data=data, tokenizer=tokenizer)
        return _one_per_record(records=records, encode=encode, tokenizer=tokenizer, seq_length=seq_length, kind=kind)
    used_template = bool(getattr(tokenizer, "chat_template", None))
    if not used_template:
        log.warning("tokenizer has no chat_template: rendering chat records as '<role>: <content>\\n' lines")
    encode = _chat_encoder(field=data.messages_field, tokenizer=tokenizer, use_template=used_template)
    examples = _one_per_record(records=records, encode=encode, tokenizer=tokenizer, seq_length=seq_length, kind=kind)
    return replace(examples, used_chat_template=used_template)


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


def _pack_text(*, records, field: str, tokenizer, seq_length: int) -> Examples:
    eos = tokenizer.eos_token_id

    def encode(batch, indices):
        _check_strings(batch[field], field=field, offset=indices[0])
        ids = tokenizer(batch[field])["input_ids"]
        # EOS ends every document; a tokenizer that appends EOS itself must not get a second one.
        return {"ids": [doc if doc and doc[-1] == eos else doc + [eos] for doc in ids]}

    docs = _map(records, encode=encode, desc="tokenize-text")["ids"]
    stream = np.fromiter((t for doc in docs for t in doc), dtype=np.int64)
    example_length = seq_length + 1
    num_examples = len(stream) // example_length
    if num_examples == 0:
        raise DsmtError(
            f"the corpus has {len(stream)} tokens ({len(docs)} documents, EOS included) but one example needs "
            f"seq_length + 1 = {example_length}; add text or lower training.seq_length below {len(stream)}"
        )
    token_ids = torch.from_numpy(stream[: num_examples * example_length].reshape(num_examples, example_length))
    return Examples(token_ids=token_ids, loss_mask=torch.ones(num_examples, seq_length), kind="text")


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


def _one_per_record(*, records, encode, tokenizer, seq_length: int, kind: str) -> Examples:
    mapped = _map(records, encode=encode, desc=f"tokenize-{kind}")
    example_length = seq_length + 1
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, masks, truncated = [], [], 0
    for ids, target in zip(mapped["ids"], mapped["target"]):
        truncated += len(ids) > example_length
        ids, target = ids[:example_length], target[:example_length]
        if not any(target[1:]):  # target[0] is never a label: nothing precedes the first token
            continue
        fill = example_length - len(ids)
        rows.append(ids + [pad] * fill)
        masks.append(target[1:] + [0] * fill)
    if not rows:
        raise DsmtError(f"none of the {len(records)} {kind} records has a loss-bearing token within seq_length + 1 = "
                        f"{example_length} tokens; raise training.seq_length or shorten the prompts")
    return Examples(token_ids=torch.tensor(rows, dtype=torch.int64),
                    loss_mask=torch.tensor(masks, dtype=torch.float32), kind=kind,
                    num_dropped=len(records) - len(rows), num_truncated=truncated)


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
