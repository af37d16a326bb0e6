"""Canonical records -> token ids and loss targets, with the checkpoint's own tokenizer (the tokenisation stage).

A record reaches here through its type's formatting (toolkit/data/formats.py) as one of three canonical kinds:

* text (`{"text"}`): each document is tokenised as the tokenizer does by default (BOS if it adds one), followed
  by EOS (a tokenizer that already ends it with EOS gets no second one). Every label inside the document counts,
  its EOS included: a document of L tokens has L - 1 labels. With the dsmt tiny tokenizer (no BOS) document `ab`
  is `a b EOS`.
* prompt/completion (`{"prompt", "completion"}`; Alpaca records with their template): `prompt (tokenizer's
  default specials; a second leading BOS, from a prompt already rendered with its template, dropped) + completion
  + EOS`. Labels count on the completion and its EOS only. No chat template.
* chat (`{"messages": [{"role", "content"}]}`; ShareGPT records with their roles mapped): rendered with
  `tokenizer.apply_chat_template` when the tokenizer has a `chat_template`, else with the fallback
  `"<role>: <content>\\n"` per message and EOS after a final assistant turn (`Examples.used_chat_template` and a log
  line say which). Labels count on each assistant turn: the text between the prompt rendered with
  `add_generation_prompt=True` and the conversation rendered up to and including that turn, so the template's
  end-of-turn marker is learned as well (toolkit/data/encoding.py, which the preference tokeniser shares).

`tokenize_examples` then fits the records into rows (toolkit/data/packing.py: the long-record policy, packing).
Preference records (`data.type: preference`) become pairs instead (toolkit/data/preference.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING

from toolkit.data.encoding import (assistant_spans, formatted, map_records, prompt_ids, span_targets,
                                    uses_chat_template, with_completions)
from toolkit.data.examples import Examples
from toolkit.data.formats import canonical_kind
from toolkit.data.packing import pack_examples
from toolkit.data.preference import tokenize_preference
from toolkit.data.records import record_type
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

if TYPE_CHECKING:
    from toolkit.data.preference_rows import PreferenceExamples

log = logging.getLogger(__name__)


def record_kind(*, data: DataSpec) -> str:
    """The canonical kind `data`'s records become: "text", "prompt_completion", "chat" or "preference"."""
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


def tokenize_examples(*, records, data: DataSpec, tokenizer, seq_length: int) -> Examples | PreferenceExamples:
    """Tokenise `records` (from `load_records`) and fit them into `Examples` of `seq_length + 1` ids (packing.py);
    preference records into `PreferenceExamples` (toolkit/data/preference_rows.py)."""
    if seq_length < 1:
        raise DsmtError(f"seq_length={seq_length} must be at least 1")
    if tokenizer.eos_token_id is None:
        raise DsmtError("the tokenizer has no eos_token; documents and completions are terminated with EOS, so set "
                        "eos_token in its tokenizer_config.json")
    kind = record_kind(data=data)
    if kind == "preference":
        return tokenize_preference(records=records, data=data, tokenizer=tokenizer, seq_length=seq_length)
    used_template = uses_chat_template(tokenizer) if kind == "chat" else None
    encode = _encoder(kind=kind, tokenizer=tokenizer, use_template=used_template)
    mapped = map_records(records, encode=formatted(encode, data=data), desc=f"tokenize-{kind}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = pack_examples(ids=mapped["ids"], targets=mapped["target"], kind=kind, seq_length=seq_length,
                             pad=pad, packed=data.packing, used_chat_template=used_template)
    log.info("data: %s (data.packing=%s)", examples.describe(), data.packing)
    return examples


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
    def encode(records):
        prompts = prompt_ids(tokenizer=tokenizer, prompts=[r["prompt"] for r in records])
        ids, target = with_completions(tokenizer=tokenizer, prompts=prompts,
                                       completions=[r["completion"] for r in records])
        return {"ids": ids, "target": target}

    return encode


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
            target = span_targets(offsets, spans)
            if not use_template:  # the fallback has no end-of-turn marker: EOS teaches the model to stop
                ids, target = ids + [eos], target + [int(final)]
            ids_out.append(list(ids))
            target_out.append(target)
        return {"ids": ids_out, "target": target_out}

    return encode
