"""Preference records (`data.type: preference`, for DPO) -> tokenised pairs (the tokenisation stage for pairs).

A record reaches here formatted (toolkit/data/formats.py `format_preference`, TRL's forms) as
`{"prompt", "chosen", "rejected"}`: three strings, or three lists of `{"role", "content"}` messages (an implicit
prompt already split off). Each side is tokenised as SFT tokenises its kind (toolkit/data/tokenize.py):

* strings: `prompt` with the tokenizer's default specials (one leading BOS), then the completion without them,
  then EOS; labels count on the completion and its EOS;
* messages: `prompt + completion` rendered as SFT renders chats (toolkit/data/encoding.py: the chat template, or
  the `"<role>: <content>\\n"` fallback with EOS); labels count on the assistant turns of the completion only, not
  on assistant turns inside the prompt (a token overlapping a reply is the reply's). The prompt's tokens are those
  before the first token reaching past the rendered prompt, with the generation prompt when the completion opens
  with an assistant turn (TRL's prompt rendering).

All records of a source have the first record's form (one tokenisation for all). toolkit/data/preference_rows.py
then cuts each pair to the row length and lays it out in rows.
"""

from __future__ import annotations

import logging

from toolkit.data.encoding import (assistant_spans, formatted, map_records, prompt_ids, render_chat, span_targets,
                                   uses_chat_template, with_completions)
from toolkit.data.formats import RecordError, format_preference
from toolkit.data.preference_rows import SIDES, PreferenceError, PreferenceExamples, pair_examples
from toolkit.errors import DsmtError

log = logging.getLogger("toolkit.data.tokenize")  # the tokenisation stage's logger: one place to quiet both kinds


def tokenize_preference(*, records, data, tokenizer, seq_length: int) -> PreferenceExamples:
    """`PreferenceExamples` of the preference `records` (from `load_records`): each side tokenised by its form
    (module docstring), each pair cut and laid out in rows of `seq_length + 1` ids by `data.packing`."""
    conversational = _messages_form(records)
    used_template = uses_chat_template(tokenizer) if conversational else None
    encode = (_chat_encoder(tokenizer=tokenizer, use_template=used_template) if conversational
              else _string_encoder(tokenizer=tokenizer))
    mapped = map_records(records, encode=formatted(_one_form(encode, conversational=conversational), data=data),
                         desc="tokenize-preference")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = pair_examples(mapped=mapped, seq_length=seq_length, pad=pad, packed=data.packing,
                             used_chat_template=used_template)
    log.info("data: %s (data.packing=%s)", examples.describe(), data.packing)
    return examples


def _messages_form(records) -> bool:
    """Whether the first record holds message lists (else strings): the form every record must have."""
    if len(records) == 0:
        raise PreferenceError(rule="data_empty", message="there are no preference records",
                              fix="give a non-empty dataset")
    return isinstance(format_preference(dict(records[0]), index=0)["chosen"], list)


def _one_form(encode, *, conversational: bool):
    """`encode`, refusing a record whose form (strings / messages) is not the first record's."""

    def encode_one_form(records):
        for record in records:
            if isinstance(record["chosen"], list) != conversational:
                form, other = ("message lists", "strings") if conversational else ("strings", "message lists")
                raise RecordError(rule="record_field_type", index=record["index"], what=f"holds {other} but "
                                  f"record 1 holds {form}", fix="give every record of a source in one form")
        return encode(records)

    return encode_one_form


def _string_encoder(*, tokenizer):
    def encode(records):
        prompts = prompt_ids(tokenizer=tokenizer, prompts=[r["prompt"] for r in records])  # once for both sides
        out = {}
        for side in SIDES:
            out[f"{side}_ids"], out[f"{side}_target"] = with_completions(
                tokenizer=tokenizer, prompts=prompts, completions=[r[side] for r in records])
            out[f"{side}_prompt"] = [len(p) for p in prompts]
        return out

    return encode


def _chat_encoder(*, tokenizer, use_template: bool):
    eos = tokenizer.eos_token_id

    def encode(records):
        out = {}
        for side in SIDES:
            rendered = [_render_side(tokenizer=tokenizer, prompt=r["prompt"], completion=r[side],
                                     use_template=use_template, index=r["index"]) for r in records]
            # The template writes BOS and turn markers itself; offsets map each token back to the rendered text.
            encoded = tokenizer([text for text, _, _ in rendered], add_special_tokens=False,
                                return_offsets_mapping=True)
            ids_out, target_out, prompt_out = [], [], []
            for ids, offsets, (_, spans, prompt_chars), record in zip(encoded["input_ids"], encoded["offset_mapping"],
                                                                       rendered, records):
                target = span_targets(offsets, spans)
                if not use_template:  # the fallback has no end-of-turn marker: EOS teaches the model to stop
                    ids, target = list(ids) + [eos], target + [int(record[side][-1]["role"] == "assistant")]
                ids_out.append(list(ids))
                target_out.append(target)
                # the prompt: the tokens before the first one reaching past the rendered prompt
                prompt_out.append(next((t for t, (_, end) in enumerate(offsets) if end > prompt_chars), len(offsets)))
            out.update({f"{side}_ids": ids_out, f"{side}_target": target_out, f"{side}_prompt": prompt_out})
        return out

    return encode


def _render_side(*, tokenizer, prompt: list, completion: list, use_template: bool,
                 index: int) -> tuple[str, list[tuple[int, int]], int]:
    """(the rendered conversation `prompt + completion`, the character spans of the completion's assistant turns,
    the characters of the rendered prompt)."""
    text, spans = assistant_spans(tokenizer=tokenizer, messages=prompt + completion, use_template=use_template,
                                  index=index)
    in_prompt = sum(message["role"] == "assistant" for message in prompt)  # context: not learned
    opens_reply = completion[0]["role"] == "assistant"
    prompt_text = render_chat(tokenizer=tokenizer, messages=prompt, add_generation_prompt=opens_reply,
                              use_template=use_template)
    if not text.startswith(prompt_text):
        raise DsmtError(f"record {index}: the chat template renders the prompt differently once the completion "
                        f"follows, so the prompt's tokens cannot be located; use a template whose renderings are "
                        f"prefixes of each other, or give the records as strings")
    return text, spans[in_prompt:], len(prompt_text)
