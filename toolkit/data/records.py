"""What the `data` section says about its records: their type (`data.type`, `auto` resolved from the field
options) and the fields that type reads, for the formatting stage (toolkit/data/formats.py)."""

from __future__ import annotations

from toolkit.data.formats import RecordFields, resolve_type
from toolkit.spec.data_schema import RecordSource

# The fields each type must find in a record (Alpaca's `input` is optional); None: the type's default name.
DEFAULT_FIELDS = {"text": ("text_field", "text"), "sharegpt": ("messages_field", "conversations"),
                  "messages": ("messages_field", "messages")}


def record_type(source: RecordSource) -> str:
    """One of toolkit/data/formats.py RECORD_TYPES: `data.type`, or for `auto` the type the field options imply."""
    return resolve_type(type_=source.type, text_field=source.text_field, prompt_field=source.prompt_field,
                        completion_field=source.completion_field, messages_field=source.messages_field)


def record_fields(source: RecordSource) -> RecordFields:
    return RecordFields(text_field=source.text_field, prompt_field=source.prompt_field,
                        completion_field=source.completion_field, messages_field=source.messages_field)


def required_fields(source: RecordSource) -> list[str]:
    """The record columns the formatting of `source`'s type reads (every record must have them)."""
    kind = record_type(source)
    if kind == "alpaca":
        return ["instruction", "output"]
    if kind == "completion":
        return [source.prompt_field or "prompt", source.completion_field or "completion"]
    option, default = DEFAULT_FIELDS[kind]
    return [getattr(source, option) or default]
