"""Formatting by type (toolkit/data/formats.py): each type's canonical record, each error's message, auto type
resolution and whole-source checks with line numbers. Pure functions, no tokenizer."""

import json
import pickle

import pytest

from toolkit.data.formats import (ALPACA_PROMPT_NO_INPUT, ALPACA_PROMPT_WITH_INPUT, RECORD_TYPES, RecordCheck,
                                  RecordError, RecordFields, canonical_kind, check_records, format_alpaca,
                                  format_record, line_numbers, resolve_type)
from toolkit.errors import DsmtError

DEFAULTS = RecordFields()
TYPES = "text, completion, alpaca, sharegpt, messages, preference"


def _error(record, record_type, *, fields=DEFAULTS, index=0) -> RecordError:
    with pytest.raises(RecordError) as caught:
        format_record(record, record_type=record_type, fields=fields, index=index)
    return caught.value


def test_alpaca_templates_are_stanford_alpaca_verbatim():
    assert ALPACA_PROMPT_WITH_INPUT == (
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n"
        "{input}\n\n### Response:\n")
    assert ALPACA_PROMPT_NO_INPUT == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def test_alpaca_with_input():
    record = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    assert format_record(record, record_type="alpaca", fields=DEFAULTS, index=0) == {
        "prompt": "Below is an instruction that describes a task, paired with an input that provides further "
                  "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                  "Add the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n",
        "completion": "5"}


@pytest.mark.parametrize("extra", [{}, {"input": None}, {"input": ""}, {"input": "  \n\t"}])
def test_alpaca_without_input(extra):
    record = {"instruction": "Name a colour.", "output": "Blue", **extra}
    assert format_alpaca(record) == {
        "prompt": "Below is an instruction that describes a task. Write a response that appropriately completes "
                  "the request.\n\n### Instruction:\nName a colour.\n\n### Response:\n",
        "completion": "Blue"}


def test_text_and_completion_with_default_and_renamed_fields():
    assert format_record({"text": "ab", "id": 1}, record_type="text", fields=DEFAULTS, index=0) == {"text": "ab"}
    assert format_record({"body": "cd"}, record_type="text", fields=RecordFields(text_field="body"),
                         index=0) == {"text": "cd"}
    assert format_record({"prompt": "p", "completion": "c"}, record_type="completion", fields=DEFAULTS,
                         index=0) == {"prompt": "p", "completion": "c"}
    renamed = RecordFields(prompt_field="q", completion_field="a")
    assert format_record({"q": "2+2?", "a": "4"}, record_type="completion", fields=renamed,
                         index=0) == {"prompt": "2+2?", "completion": "4"}


def test_sharegpt_maps_speakers_to_chat_roles():
    record = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello"}]}
    assert format_record(record, record_type="sharegpt", fields=DEFAULTS, index=0) == {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]}


def test_sharegpt_accepts_user_assistant_and_role_content_keys():
    # As `datasets` loads mixed turns: every key on every turn, None where the turn lacks it.
    turns = [{"role": "user", "content": "Hi", "from": None, "value": None},
             {"from": "assistant", "value": "Yo", "role": None, "content": None, "weight": 1}]
    assert format_record({"chat": turns}, record_type="sharegpt", fields=RecordFields(messages_field="chat"),
                         index=0) == {"messages": [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Yo"}]}


def test_messages_keep_role_and_content_only():
    record = {"messages": [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": "Yo"}]}
    assert format_record(record, record_type="messages", fields=DEFAULTS, index=0) == {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    no_assistant = {"messages": [{"role": "user", "content": "Hi"}]}  # tokenize drops it; not an error here
    assert format_record(no_assistant, record_type="messages", fields=DEFAULTS, index=0) == no_assistant


@pytest.mark.parametrize("record_type, fields, record, message", [
    ("text", DEFAULTS, {"body": "x", "id": 1},
     f"record 1: no field 'text' (fields present: body, id); set data.text_field to the field that holds it, or set "
     f"data.type to the records' type ({TYPES})"),
    ("completion", RecordFields(prompt_field="q", completion_field="a"), {"q": "x", "answer": "y"},
     f"record 1: no field 'a' (fields present: q, answer); set data.completion_field to the field that holds it, "
     f"or set data.type to the records' type ({TYPES})"),
    ("alpaca", DEFAULTS, {"instruction": "x", "response": "y"},
     f"record 1: no field 'output' (fields present: instruction, response); set data.type to the records' type "
     f"({TYPES})"),
    ("sharegpt", DEFAULTS, {"messages": []},
     f"record 1: no field 'conversations' (fields present: messages); set data.messages_field to the field that "
     f"holds it, or set data.type to the records' type ({TYPES})"),
])
def test_missing_field_names_the_field_the_fields_present_and_the_option(record_type, fields, record, message):
    error = _error(record, record_type, fields=fields)
    assert (error.rule, error.index, str(error)) == ("record_missing_field", 0, message)


def test_null_field_is_missing_and_keeps_the_type_name():
    error = _error({"text": None, "body": "x"}, "text", index=4)
    assert error.rule == "record_missing_field"
    assert str(error).startswith("record 5: field 'text' is NoneType: null or absent (fields present: body); ")


def test_wrong_type_names_the_type_found_and_expected():
    error = _error({"text": ["a", "b"]}, "text", index=2)
    assert (error.rule, error.index) == ("record_field_type", 2)
    assert str(error) == (f"record 3: field 'text' is list (['a', 'b']), expected str; make 'text' a str in every "
                          f"record; or set data.text_field to the field that holds it, or set data.type to the "
                          f"records' type ({TYPES})")
    assert "field 'messages' is str ('hi'), expected list" in str(_error({"messages": "hi"}, "messages"))
    assert "field 'input' is int (3), expected str" in str(
        _error({"instruction": "x", "input": 3, "output": "y"}, "alpaca"))
    error = _error({"messages": [{"role": "user", "content": 7}]}, "messages", index=1)
    assert (error.rule, str(error)) == ("record_field_type", "record 2: turn 0 of 'messages' has content int (7), "
                                                            "expected str; give every turn its text as a string")
    assert str(_error(["x"], "text")).startswith("record 1: is list, expected an object of fields")


def test_unknown_role_names_the_role_the_turn_and_the_accepted_roles():
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "call"}, {"from": "tool", "value": "42"}]
    error = _error({"conversations": turns}, "sharegpt", index=3)
    assert (error.rule, error.index) == ("record_unknown_role", 3)
    assert str(error) == ("record 4: turn 2 of 'conversations' has role 'tool'; accepted roles: system, human, "
                          "user, gpt, assistant; map the turn to one of those roles, or drop it, before training")
    error = _error({"messages": [{"role": "human", "content": "q"}]}, "messages")
    assert "turn 0 of 'messages' has role 'human'; accepted roles: system, user, assistant" in str(error)


def test_turn_without_role_or_content_and_empty_conversation():
    error = _error({"conversations": [{"value": "q"}]}, "sharegpt")
    assert (error.rule, str(error)) == ("record_missing_field", "record 1: turn 0 of 'conversations' has no 'from' "
                                        "or 'role' (keys present: value); give every turn a role and its text")
    error = _error({"messages": [{"role": "user", "content": None}]}, "messages")
    assert error.rule == "record_missing_field" and "turn 0 of 'messages' has no 'content'" in str(error)
    error = _error({"messages": []}, "messages", index=5)
    assert (error.rule, str(error)) == ("record_empty", "record 6: field 'messages' is an empty list; give every "
                                                        "conversation at least one turn, or drop the record")


def test_resolve_type_and_canonical_kind():
    assert resolve_type(type_="auto", text_field="text") == "text"
    assert resolve_type(type_="auto", text_field="body", prompt_field=None, completion_field=None,
                        messages_field=None) == "text"
    assert resolve_type(type_="auto", prompt_field="q", completion_field="a") == "completion"
    assert resolve_type(type_="auto", text_field="text", messages_field="chat") == "messages"
    assert resolve_type(type_="sharegpt", messages_field="chat") == "sharegpt"
    assert [canonical_kind(t) for t in RECORD_TYPES] == ["text", "prompt_completion", "prompt_completion", "chat",
                                                         "chat", "preference"]
    with pytest.raises(DsmtError, match=r"record type 'chatml' is not one of text, completion, alpaca, sharegpt"):
        resolve_type(type_="chatml")
    with pytest.raises(DsmtError, match=r"record type 'auto' is not one of"):
        canonical_kind("auto")


def _bad_text_records():
    return [{"text": "ok"} if i % 3 else {"body": str(i)} for i in range(10)]  # records 0, 3, 6, 9 are bad


def test_check_records_counts_all_bad_and_keeps_the_first_limit():
    check = check_records(_bad_text_records(), record_type="text", fields=DEFAULTS, limit=2)
    assert (check.num_records, check.num_bad, [e.index for e in check.errors]) == (10, 4, [0, 3])
    assert all(e.line is None for e in check.errors) and not check.ok
    assert check.describe() == ("4 of 10 records cannot be formatted:\n  " + str(check.errors[0]) + "\n  "
                                + str(check.errors[1]) + "\n  ... and 2 more")
    good = check_records([{"text": "a"}], record_type="text", fields=DEFAULTS)
    assert good == RecordCheck(errors=(), num_bad=0, num_records=1) and good.describe() == "all 1 records format"


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_check_records_gives_jsonl_lines_skipping_blank_ones(tmp_path):
    rows = [{"text": "a"}, {"body": "b"}, {"text": "c"}, {"text": 5}]
    lines = [json.dumps(rows[0]), "", json.dumps(rows[1]), "   ", "", json.dumps(rows[2]), json.dumps(rows[3])]
    source = _write_lines(tmp_path / "data.jsonl", lines)
    check = check_records(rows, record_type="text", fields=DEFAULTS, source=source)
    assert [(e.index, e.line) for e in check.errors] == [(1, 3), (3, 7)] and check.num_bad == 2
    assert str(check.errors[0]).startswith(f"record 2 (line 3 of {source}): no field 'text' (fields present: body)")
    assert check.errors[1].rule == "record_field_type"


def test_line_numbers_only_for_json_lines(tmp_path):
    lines = ['{"text": "a"}', "", '{"text": "b"}']
    assert line_numbers(path=_write_lines(tmp_path / "a.json", lines), indices=[0, 1]) == {0: 1, 1: 3}
    listed = _write_lines(tmp_path / "b.json", ["[", '  {"text": "a"},', '  {"text": "b"}', "]"])
    assert line_numbers(path=listed, indices=[1]) == {}
    assert line_numbers(path=_write_lines(tmp_path / "c.csv", ["text", "a"]), indices=[0]) == {}
    assert line_numbers(path=str(tmp_path / "missing.jsonl"), indices=[0]) == {}
    check = check_records([{"text": "a"}, {"x": 1}], record_type="text", fields=DEFAULTS, source=listed)
    assert check.errors[0].line is None and str(check.errors[0]).startswith("record 2: no field 'text'")


def test_check_records_over_a_loaded_dataset(tmp_path, cache_dir):
    from toolkit.data.sources import load_records
    from toolkit.spec.schema import DataSpec

    lines = [json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
             "",
             json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]})]
    source = _write_lines(tmp_path / "chat.jsonl", lines)
    records = load_records(data=DataSpec(path=source, messages_field="messages"), cache_dir=cache_dir)
    check = check_records(records, record_type="messages", fields=RecordFields(messages_field="messages"),
                          source=source)
    assert (check.num_records, check.num_bad) == (2, 1)
    assert str(check.errors[0]).startswith(f"record 2 (line 3 of {source}): turn 1 of 'messages' has role 'tool'")


def test_record_error_pickles_with_its_attributes():
    error = RecordError(rule="record_empty", index=2, what="w", fix="f", line=9, source="d.jsonl")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rule, copy.index, copy.line, str(copy)) == ("record_empty", 2, 9, "record 3 (line 9 of d.jsonl): w; f")


def test_line_numbers_look_through_gzip(tmp_path):
    import gzip

    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n\n{"text": "b"}\n'))
    assert line_numbers(path=path, indices=[1]) == {1: 3}
