"""Canonical records -> token ids and loss targets, with the checkpoint's own tokenizer (the tokenisation stage).

A record reaches here through its type's formatting (toolkit/data/formats.py) as one of three canonical kinds:

* text (`{"text"}`): each document is tokenised as the tokenizer does by default (BOS if it adds one), followed
  by EOS (a tokenizer that already ends it with EOS gets no second one). Every label inside the document counts,
  its EOS included: a document of L tokens has L - 1 labels. With the dsmt tiny tokenizer (no BOS) document `ab`
  is `a b EOS`.
* prompt/completion (`{"prompt", "completion"}`; Alpaca records with their template): `prompt (tokenizer's
  default specials) + completion + EOS`. Labels count on the completion and its EOS only. No chat template.
* chat (`{"messages": [{"role", "content"}]}`; ShareGPT records with their roles mapped): rendered with
  `tokenizer.apply_chat_template` when the tokenizer has a `chat_template`, else with the fallback
  `"<role>: <content>\\n"` per message and EOS after a final assistant turn (`Examples.used_chat_template` and a log
  line say which). Labels count on each assistant turn: the text between the prompt rendered with
  `add_generation_prompt=True` and the conversation rendered up to and including that turn, so the template's
  end-of-turn marker is learned as well.

`tokenize_examples` then fits the records into rows (toolkit/data/packing.py: the long-record policy, packing).
"""

from __future__ import annotations

import hashlib
import json
import logging

from toolkit.data.examples import Examples
from toolkit.data.formats import canonical_kind, format_record
from toolkit.data.packing import pack_examples
from toolkit.data.records import record_fields, record_type
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

log = logging.getLogger(__name__)

MAP_BATCH_SIZE = 1000  # records per tokenizer call: big enough for the Rust tokenizer's batching to pay off


def record_kind(*, data: DataSpec) -> str:
    """The canonical kind `data`'s records become: "text", "prompt_completion" or "chat"."""
    return canonical_kind(record_type(data))


def load_tokenizer(*, data: DataSpec, model_path: str | None):
    """The tokenizer at `data.tokenizer`, else the checkpoint's own at `model_path`."""
    from transformers import AutoTokenizer

    where = data.tokenizer or model_path
    if where is None:
        raise DsmtError("no tokenizer: set data.tokenizer or model.path (a checkpoint directory with tokenizer files)")
    from toolkit.models.remote_code import refuse_remote_code

    refuse_remote_code(where)  # tokenizer_config.json's auto_map: dsmt never runs a folder's tokenization_*.py
    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=False)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())  # transformers' reasons run over several lines; a report line is one
        raise DsmtError(f"could not load a tokenizer from {where!r} ({reason}); set data.tokenizer to a directory "
                        f"holding tokenizer.json / tokenizer_config.json") from err


def tokenizer_identity(tokenizer) -> str:
    """A hash of what decides the ids: a fast tokenizer's whole serialised pipeline (vocab, merges, normalizer,
    BOS/EOS post-processing), else its vocabulary and init arguments; plus special ids and the chat template."""
    if getattr(tokenizer, "is_fast", False):
        pipeline = tokenizer.backend_tokenizer.to_str()
    else:
        settings = {k: v for k, v in tokenizer.init_kwargs.items() if k != "name_or_path"}
        pipeline = json.dumps([sorted(tokenizer.get_vocab().items()), settings], sort_keys=True, default=str)
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    described = json.dumps([type(tokenizer).__name__, pipeline, specials, getattr(tokenizer, "chat_template", None)],
                           default=str)
    return hashlib.sha256(described.encode()).hexdigest()


def tokenize_examples(*, records, data: DataSpec, tokenizer, seq_length: int) -> Examples:
    """Tokenise `records` (from `load_records`) and fit them into `Examples` of `seq_length + 1` ids (packing.py)."""
    if seq_length < 1:
        raise DsmtError(f"seq_length={seq_length} must be at least 1")
    if tokenizer.eos_token_id is None:
        raise DsmtError("the tokenizer has no eos_token; documents and completions are terminated with EOS, so set "
                        "eos_token in its tokenizer_config.json")
    kind = record_kind(data=data)
    used_template = None
    if kind == "chat":
        used_template = bool(getattr(tokenizer, "chat_template", None))
        if not used_template:
            log.warning("tokenizer has no chat_template: rendering chat records as '<role>: <content>\\n' lines")
    encode = _encoder(kind=kind, tokenizer=tokenizer, use_template=used_template)
    mapped = _map(records, encode=_formatted(encode, data=data), desc=f"tokenize-{kind}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = pack_examples(ids=mapped["ids"], targets=mapped["target"], kind=kind, seq_length=seq_length,
                             pad=pad, packed=data.packing, used_chat_template=used_template)
    log.info("data: %s (data.packing=%s)", examples.describe(), data.packing)
    return examples


def _formatted(encode, *, data: DataSpec):
    """`encode` over the batch's records formatted by `data.type` (toolkit/data/formats.py) into canonical ones."""
    kind_of_type, fields = record_type(data), record_fields(data)

    def encode_records(batch, indices):
        names = list(batch)
        records = [{**format_record(dict(zip(names, values)), record_type=kind_of_type, fields=fields, index=index),
                    "index": index} for index, values in zip(indices, zip(*(batch[name] for name in names)))]
        return encode(records)

    return encode_records


def _map(records, *, encode, desc: str):
    """`datasets.map` in batches, in memory and without the on-disk cache: the output depends on the tokenizer,
    which `datasets` cannot fingerprint reliably, and a stale cache would silently reuse old ids."""
    return records.map(encode, batched=True, batch_size=MAP_BATCH_SIZE, with_indices=True,
                       remove_columns=records.column_names, keep_in_memory=True, load_from_cache_file=False,
                       new_fingerprint=f"dsmt-{desc}-{records._fingerprint}", desc=desc)


def _encoder(*, kind: str, tokenizer, use_template: bool | None):
    if kind == "text":
        return _text_encoder(tokenizer=tokenizer)
    if kind == "prompt_completion":
        return _prompt_completion_encoder(tokenizer=tokenizer)
    return _chat_encoder(tokenizer=tokenizer, use_template=use_template)


def _text_encoder(*, tokenizer):
    eos = tokenizer.eos_token_id

    def encode(records):
        ids = tokenizer([record["text"] for record in records])["input_ids"]
        # EOS ends every document; a tokenizer that appends EOS itself must not get a second one.
        ids = [doc if doc and doc[-1] == eos else doc + [eos] for doc in ids]
        return {"ids": ids, "target": [[1] * len(doc) for doc in ids]}

    return encode


def _prompt_completion_encoder(*, tokenizer):
    eos = tokenizer.eos_token_id

    def encode(records):
        prompts = tokenizer([r["prompt"] for r in records])["input_ids"]  # BOS etc. as at inference
        completions = tokenizer([r["completion"] for r in records], add_special_tokens=False)["input_ids"]
        return {"ids": [p + c + [eos] for p, c in zip(prompts, completions)],
                "target": [[0] * len(p) + [1] * (len(c) + 1) for p, c in zip(prompts, completions)]}

    return encode


def _render(*, tokenizer, messages, add_generation_prompt: bool, use_template: bool) -> str:
    if use_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


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


def _chat_encoder(*, tokenizer, use_template: bool):
    eos = tokenizer.eos_token_id

    def encode(records):
        texts, all_spans, ends_with_assistant = [], [], []
        for record in records:
            messages = record["messages"]
            text, spans = assistant_spans(tokenizer=tokenizer, messages=messages, use_template=use_template,
                                          index=record.get("index", 0))
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
