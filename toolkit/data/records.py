"""What the `data` section says about its records: their type (`data.type`, `auto` resolved from the field
options) and the fields that type reads, for the formatting stage (toolkit/data/formats.py)."""

from __future__ import annotations

from toolkit.data.formats import RecordFields, field_names, resolve_type
from toolkit.spec.data_schema import RecordSource


def record_type(data: RecordSource) -> str:
    """One of toolkit/data/formats.py RECORD_TYPES: `data.type`, or for `auto` the type the field options imply."""
    return resolve_type(type_=data.type, text_field=data.text_field, prompt_field=data.prompt_field,
                        completion_field=data.completion_field, messages_field=data.messages_field)


def record_fields(data: RecordSource) -> RecordFields:
    return RecordFields(text_field=data.text_field, prompt_field=data.prompt_field,
                        completion_field=data.completion_field, messages_field=data.messages_field)


def required_fields(data: RecordSource) -> list[str]:
    """The record columns the formatting of `data`'s type reads (every record must have them)."""
    return field_names(record_type=record_type(data), fields=record_fields(data))
