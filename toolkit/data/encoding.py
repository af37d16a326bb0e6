"""What the SFT tokeniser (toolkit/data/tokenize.py) and the preference tokeniser (toolkit/data/preference.py)
share: the batched `datasets.map` over records formatted by `data.type`, and the rendering of chats with the
assistant turns located, so a conversation is tokenised and masked the same way for SFT and for DPO.

Chats are rendered with `tokenizer.apply_chat_template` when the tokenizer has a `chat_template`, else with the
fallback `"<role>: <content>\\n"` per message. An assistant turn is the text between the conversation before it
rendered with `add_generation_prompt=True` and the conversation through it, so the template's end-of-turn marker
is learned as well.
"""

from __future__ import annotations

import logging

from toolkit.data.formats import format_record
from toolkit.data.records import record_fields, record_type
from toolkit.errors import DsmtError
from toolkit.spec.data_schema import RecordSource

log = logging.getLogger("toolkit.data.tokenize")  # the tokenisation stage's logger: one place to quiet it

MAP_BATCH_SIZE = 1000  # records per tokenizer call: big enough for the Rust tokenizer's batching to pay off


def formatted(encode, *, data: RecordSource):
    """`encode` over the batch's records formatted by `data.type` (toolkit/data/formats.py) into canonical ones,
    each with its `index` in the source."""
    kind_of_type, fields = record_type(data), record_fields(data)

    def encode_records(batch, indices):
        names = list(batch)
        records = [{**format_record(dict(zip(names, values)), record_type=kind_of_type, fields=fields, index=index),
                    "index": index} for index, values in zip(indices, zip(*(batch[name] for name in names)))]
        return encode(records)

    return encode_records


def map_records(records, *, encode, desc: str):
    """`datasets.map` in batches, in memory and without the on-disk cache: the output depends on the tokenizer,
    which `datasets` cannot fingerprint reliably, and a stale cache would silently reuse old ids."""
    return records.map(encode, batched=True, batch_size=MAP_BATCH_SIZE, with_indices=True,
                       remove_columns=records.column_names, keep_in_memory=True, load_from_cache_file=False,
                       new_fingerprint=f"dsmt-{desc}-{records._fingerprint}", desc=desc)


def uses_chat_template(tokenizer) -> bool:
    """Whether chats render with the tokenizer's template; without one a warning says the fallback is used."""
    used = bool(getattr(tokenizer, "chat_template", None))
    if not used:
        log.warning("tokenizer has no chat_template: rendering chat records as '<role>: <content>\\n' lines")
    return used


def render_chat(*, tokenizer, messages, add_generation_prompt: bool, use_template: bool) -> str:
    if use_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def assistant_spans(*, tokenizer, messages, use_template: bool, index: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans `[start, end)` of its assistant turns."""
    full = render_chat(tokenizer=tokenizer, messages=messages, add_generation_prompt=False, use_template=use_template)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer=tokenizer, messages=messages[:turn], add_generation_prompt=True,
                             use_template=use_template)
        through = render_chat(tokenizer=tokenizer, messages=messages[: turn + 1], add_generation_prompt=False,
                              use_template=use_template)
        # Templates that rewrite earlier turns (e.g. dropping past reasoning) have no stable prefix to mask.
        if not (full.startswith(through) and through.startswith(before)):
            raise DsmtError(f"record {index}: the chat template renders turn {turn} differently once later turns "
                            f"follow, so the assistant tokens cannot be located; use a template whose renderings "
                            f"are prefixes of each other, or pre-render the chats into prompt/completion fields")
        spans.append((len(before), len(through)))
    return full, spans


def span_targets(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (by its character `offsets`) that overlaps one of `spans`, else 0; a token of no
    characters (a special token the template wrote) is never a target. Overlaps, not starts inside: a byte-level
    BPE tokenizer joins the space that ends the fallback's `assistant: ` to the reply's first word (` Yes`), which
    starts one character before the span and is the reply's first token all the same."""
    return [int(end > start and any(start < e and end > s for s, e in spans)) for start, end in offsets]


def single_bos(ids: list[int], *, tokenizer) -> list[int]:
    """A prompt's ids with one leading BOS: text that was rendered with its chat template already starts with the
    BOS token, and the tokenizer adds another (TRL tokenises such prompts without specials); one is dropped."""
    bos = tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


def prompt_ids(*, tokenizer, prompts: list[str]) -> list[list[int]]:
    """The prompts as the tokenizer encodes them at inference (its default specials), with one leading BOS."""
    return [single_bos(ids, tokenizer=tokenizer) for ids in tokenizer(prompts)["input_ids"]]


def with_completions(*, tokenizer, prompts: list[list[int]], completions: list[str]) -> tuple[list, list]:
    """(ids, target) of `prompt + completion (no specials) + EOS` for each pair of the lists; target 1 on the
    completion and its EOS only (SFT's prompt / completion records, each side of a preference pair)."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer(completions, add_special_tokens=False)["input_ids"]
    return ([p + c + [eos] for p, c in zip(prompts, encoded)],
            [[0] * len(p) + [1] * (len(c) + 1) for p, c in zip(prompts, encoded)])
