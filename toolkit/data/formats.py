"""Formatting by type: a raw record -> one of the canonical kinds toolkit/data/tokenize.py tokenises.

`data.type` picks the formatter (`auto`: `resolve_type`, from the field options set):

    type        reads                                   canonical kind      gives
    text        text_field (default "text")             text                {"text"}
    completion  prompt_field, completion_field          prompt_completion   {"prompt", "completion"}
    alpaca      instruction, input (optional), output   prompt_completion   Stanford Alpaca prompt, output
    sharegpt    messages_field ("conversations")        chat                {"messages"}, from/value mapped
    messages    messages_field ("messages")             chat                {"messages"}
    preference  prompt, chosen, rejected (TRL's names;  preference          {"prompt", "chosen", "rejected"}: all
                prompt optional in message lists)                           strings, or all message lists
                                                                            (TRL's forms, format_preference)

Each formatter is a pure function of one record. A record it cannot read raises `RecordError` (the rule, the
record index, what is wrong, the fix); `check_records` runs them over a whole source before tokenising and
gives the bad records' lines. A conversation without an assistant turn is not an error: tokenize drops it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from toolkit.data.files import line_numbers
from toolkit.errors import DsmtError

RECORD_TYPES = ("text", "completion", "alpaca", "sharegpt", "messages", "preference")
CANONICAL_KINDS = {"text": "text", "completion": "prompt_completion", "alpaca": "prompt_completion",
                   "sharegpt": "chat", "messages": "chat", "preference": "preference"}
# The Stanford Alpaca templates, verbatim (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n")
CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
# ShareGPT speaker -> chat role: the FastChat names (human, gpt) and the chat names themselves.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# The fields each type reads: (the RecordFields option that renames it, its default name); Alpaca's and preference's
# names are fixed (Alpaca's `input` is optional, and so is preference's `prompt` in the conversational form: not listed).
TYPE_FIELDS = {"text": (("text_field", "text"),),
               "completion": (("prompt_field", "prompt"), ("completion_field", "completion")),
               "alpaca": ((None, "instruction"), (None, "output")),
               "sharegpt": (("messages_field", "conversations"),), "messages": (("messages_field", "messages"),),
               "preference": ((None, "chosen"), (None, "rejected"))}
_TYPE_FIX = f"set data.type to the records' type ({', '.join(RECORD_TYPES)})"


class RecordError(DsmtError):
    """One record that its type's formatter cannot read: `record {index + 1}{where}: {what}; {fix}` (index from 0)."""

    def __init__(self, *, rule: str, index: int, what: str, fix: str, line: int | None = None,
                 source: str | None = None):
        self.rule, self.index, self.what, self.fix, self.line, self.source = rule, index, what, fix, line, source
        where = f" (line {line} of {source})" if line is not None else ""
        super().__init__(f"record {index + 1}{where}: {what}; {fix}")  # 1-based, as editors count

    def located(self, *, line: int, source: str) -> RecordError:
        """The same error, naming the line of `source` the record is on."""
        return RecordError(rule=self.rule, index=self.index, what=self.what, fix=self.fix, line=line, source=source)

    def __reduce__(self):  # keyword-only __init__: pickle (worker processes) through the keywords
        return functools.partial(RecordError, **{k: getattr(self, k) for k in
                                                 ("rule", "index", "what", "fix", "line", "source")}), ()


@dataclasses.dataclass(frozen=True)
class RecordFields:
    """The field options of the data section; None: the type's default name."""

    text_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None


def _present(record: Mapping) -> str:
    return ", ".join(str(k) for k, v in record.items() if v is not None) or "(none)"


def _field(record: Mapping, name: str, *, index: int, option: str | None, expected: type = str):
    """`record[name]`, which must exist and be an `expected`; `option` is the spec option that renames it."""
    fix = f"set {option} to the field that holds it, or {_TYPE_FIX}" if option else _TYPE_FIX
    value = record.get(name)
    if value is None:  # `datasets` gives a field some records lack to all of them, as None where absent
        what = f"field {name!r} is NoneType: null or absent" if name in record else f"no field {name!r}"
        raise RecordError(rule="record_missing_field", index=index,
                          what=f"{what} (fields present: {_present(record)})", fix=fix)
    if not isinstance(value, expected):
        found, wanted = type(value).__name__, expected.__name__
        raise RecordError(rule="record_field_type", index=index,
                          what=f"field {name!r} is {found} ({value!r:.60}), expected {wanted}",
                          fix=f"make {name!r} a {wanted} in every record; or {fix}")
    return value


def format_text(record: Mapping, *, field: str = "text", index: int = 0) -> dict:
    return {"text": _field(record, field, index=index, option="data.text_field")}


def format_completion(record: Mapping, *, prompt_field: str = "prompt", completion_field: str = "completion",
                      index: int = 0) -> dict:
    return {"prompt": _field(record, prompt_field, index=index, option="data.prompt_field"),
            "completion": _field(record, completion_field, index=index, option="data.completion_field")}


def format_alpaca(record: Mapping, *, index: int = 0) -> dict:
    """The Stanford Alpaca prompt; an `input` missing, null or only whitespace takes the no-input template."""
    instruction = _field(record, "instruction", index=index, option=None)
    output = _field(record, "output", index=index, option=None)
    given = record.get("input")
    if given is not None and not isinstance(given, str):
        _field(record, "input", index=index, option=None)  # raises the type error
    if given is None or not given.strip():
        return {"prompt": ALPACA_PROMPT_NO_INPUT.format(instruction=instruction), "completion": output}
    return {"prompt": ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=given), "completion": output}


def _first(turn: Mapping, keys: tuple[str, ...]):
    # Loaded through `datasets`, a turn holds every key any turn has, the absent ones as None.
    return next((turn[k] for k in keys if turn.get(k) is not None), None)


def _turn(turn, *, number: int, where: str, index: int, roles: dict, keys: tuple[tuple[str, ...], ...]) -> dict:
    role_keys, content_keys = keys
    if not isinstance(turn, Mapping):
        raise RecordError(rule="record_field_type", index=index,
                          what=f"turn {number} of {where} is {type(turn).__name__}, expected dict",
                          fix=f"make each turn a {{{role_keys[0]!r}: ..., {content_keys[0]!r}: ...}} object")
    role, content = _first(turn, role_keys), _first(turn, content_keys)
    for value, names in ((role, role_keys), (content, content_keys)):
        if value is None:
            raise RecordError(rule="record_missing_field", index=index,
                              what=f"turn {number} of {where} has no {' or '.join(map(repr, names))} "
                                   f"(keys present: {_present(turn)})", fix="give every turn a role and its text")
    if not isinstance(role, str) or role not in roles:
        raise RecordError(rule="record_unknown_role", index=index,
                          what=f"turn {number} of {where} has role {role!r}; accepted roles: {', '.join(roles)}",
                          fix="map the turn to one of those roles, or drop it, before training")
    if not isinstance(content, str):
        raise RecordError(rule="record_field_type", index=index,
                          what=f"turn {number} of {where} has {'/'.join(content_keys)} {type(content).__name__} "
                               f"({content!r:.60}), expected str", fix="give every turn its text as a string")
    return {"role": roles[role], "content": content}


def _chat(record: Mapping, *, field: str, index: int, roles: dict, keys: tuple[tuple[str, ...], ...]) -> dict:
    turns = _field(record, field, index=index, option="data.messages_field", expected=list)
    if not turns:
        raise RecordError(rule="record_empty", index=index, what=f"field {field!r} is an empty list",
                          fix="give every conversation at least one turn, or drop the record")
    return {"messages": [_turn(turn, number=number, where=repr(field), index=index, roles=roles, keys=keys)
                         for number, turn in enumerate(turns)]}


def format_sharegpt(record: Mapping, *, field: str = "conversations", index: int = 0) -> dict:
    """`[{"from", "value"}]` (or role/content keys) -> chat messages, speakers mapped by SHAREGPT_ROLES."""
    return _chat(record, field=field, index=index, roles=SHAREGPT_ROLES, keys=(("from", "role"), ("value", "content")))


def format_messages(record: Mapping, *, field: str = "messages", index: int = 0) -> dict:
    return _chat(record, field=field, index=index, roles=CHAT_ROLES, keys=(("role",), ("content",)))


_FORM_FIX = ("give prompt, chosen and rejected in one form: all strings, or all lists of {'role', 'content'} "
             "messages (the prompt may then be left out: the messages chosen and rejected open with are the prompt)")


def format_preference(record: Mapping, *, index: int = 0) -> dict:
    """`{"prompt", "chosen", "rejected"}` (TRL's forms): three strings, or three message lists; without a prompt
    the messages chosen and rejected open with (their longest common prefix) are the prompt."""
    chosen, rejected = (_preference_side(record, name, index=index) for name in ("chosen", "rejected"))
    prompt = record.get("prompt")
    if isinstance(chosen, str):
        if not isinstance(rejected, str):
            raise _mixed_forms(index=index, name="rejected", value=rejected, form="str")
        if prompt is None:
            raise RecordError(rule="record_missing_field", index=index, what="no field 'prompt' (chosen and rejected "
                              "are strings; only message lists may leave the prompt implicit)",
                              fix=f"give every record a prompt; or {_FORM_FIX}")
        if not isinstance(prompt, str):
            raise _mixed_forms(index=index, name="prompt", value=prompt, form="str")
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if not isinstance(rejected, list):
        raise _mixed_forms(index=index, name="rejected", value=rejected, form="list")
    if prompt is not None and not isinstance(prompt, list):
        raise _mixed_forms(index=index, name="prompt", value=prompt, form="list")
    chosen, rejected = (_chat_turns(turns, name=name, index=index)
                        for turns, name in ((chosen, "chosen"), (rejected, "rejected")))
    if prompt is None:
        return _implicit_prompt(chosen=chosen, rejected=rejected, index=index)
    for name, completion in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not completion:  # an empty prompt has no rendering a chat template accepts, nor a place to start
            raise RecordError(rule="record_empty", index=index, what=f"field {name!r} is an empty list",
                              fix="give the prompt its messages (a user turn) and each side at least one message "
                                  "after it, or drop the record")
    return {"prompt": _chat_turns(prompt, name="prompt", index=index), "chosen": chosen, "rejected": rejected}


def _preference_side(record: Mapping, name: str, *, index: int):
    value = _field(record, name, index=index, option=None, expected=object)  # raises record_missing_field
    if not isinstance(value, (str, list)):
        raise RecordError(rule="record_field_type", index=index, what=f"field {name!r} is {type(value).__name__} "
                          f"({value!r:.60}), expected str or a list of messages", fix=_FORM_FIX)
    return value


def _mixed_forms(*, index: int, name: str, value, form: str) -> RecordError:
    return RecordError(rule="record_field_type", index=index, what=f"field {name!r} is {type(value).__name__} "
                       f"({value!r:.60}) but 'chosen' is {form}", fix=_FORM_FIX)


def _chat_turns(turns: list, *, name: str, index: int) -> list[dict]:
    return [_turn(turn, number=number, where=repr(name), index=index, roles=CHAT_ROLES, keys=(("role",), ("content",)))
            for number, turn in enumerate(turns)]


def _implicit_prompt(*, chosen: list[dict], rejected: list[dict], index: int) -> dict:
    """The messages chosen and rejected share at their start are the prompt; each side keeps at least its last
    message (TRL's `extract_prompt`: a pair whose sides are equal, or one a prefix of the other, stays a pair, of
    identical or longer completions, and only a file of identical pairs is refused)."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    shared = min(shared, min(len(chosen), len(rejected)) - 1)
    if shared < 1:
        raise RecordError(rule="record_empty", index=index, what="chosen and rejected share no first message, so "
                          "the record has no prompt (the implicit prompt is the messages both sides start with)",
                          fix="start both sides with the same prompt messages (a user turn), or give an explicit "
                              "'prompt' list and the completions alone in chosen / rejected")
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def _check_type(record_type: str) -> None:
    if record_type not in RECORD_TYPES:
        raise DsmtError(f"record type {record_type!r} is not one of {', '.join(RECORD_TYPES)}; set data.type to one "
                        f"of them (or auto, resolved by resolve_type)")


def canonical_kind(record_type: str) -> str:
    """"text", "prompt_completion", "chat" or "preference": what records of `record_type` become."""
    _check_type(record_type)
    return CANONICAL_KINDS[record_type]


def resolve_type(*, type_: str, text_field: str | None = None, prompt_field: str | None = None,
                 completion_field: str | None = None, messages_field: str | None = None) -> str:
    """`type_`, or for `auto` the type the field options imply: messages_field -> messages, prompt_field /
    completion_field -> completion, else text. (`text_field` needs no test: text is what is left.)"""
    if type_ != "auto":
        _check_type(type_)
        return type_
    if messages_field is not None:
        return "messages"
    return "completion" if prompt_field is not None or completion_field is not None else "text"


def format_record(record: Mapping, *, record_type: str, fields: RecordFields, index: int) -> dict:
    """`record` as its canonical kind (`canonical_kind(record_type)`); raises RecordError when it cannot be."""
    _check_type(record_type)
    if not isinstance(record, Mapping):
        raise RecordError(rule="record_field_type", index=index, what=f"is {type(record).__name__}, expected an "
                          f"object of fields", fix="give one JSON object per record")
    names = field_names(record_type=record_type, fields=fields)
    if record_type == "text":
        return format_text(record, field=names[0], index=index)
    if record_type == "completion":
        return format_completion(record, prompt_field=names[0], completion_field=names[1], index=index)
    if record_type == "alpaca":
        return format_alpaca(record, index=index)
    if record_type == "sharegpt":
        return format_sharegpt(record, field=names[0], index=index)
    if record_type == "preference":
        return format_preference(record, index=index)
    return format_messages(record, field=names[0], index=index)


def field_names(*, record_type: str, fields: RecordFields) -> list[str]:
    """The fields a record of `record_type` must hold, by the options in `fields` (TYPE_FIELDS)."""
    _check_type(record_type)
    return [(getattr(fields, option) if option else None) or default for option, default in TYPE_FIELDS[record_type]]


@dataclasses.dataclass(frozen=True)
class RecordCheck:
    """What `check_records` found: the first bad records' errors (in record order) and the counts."""

    errors: tuple[RecordError, ...]
    num_bad: int
    num_records: int
    num_identical: int = 0  # preference records whose chosen equals their rejected: pairs that teach nothing

    @property
    def ok(self) -> bool:
        return self.num_bad == 0

    def describe(self) -> str:
        if self.ok:
            return f"all {self.num_records} records format"
        more = f"\n  ... and {self.num_bad - len(self.errors)} more" if self.num_bad > len(self.errors) else ""
        shown = "".join(f"\n  {error}" for error in self.errors)
        return f"{self.num_bad} of {self.num_records} records cannot be formatted:{shown}{more}"


def check_records(records, *, record_type: str, fields: RecordFields, source: str | None = None,
                  limit: int = 5) -> RecordCheck:
    """Format every record of `records` (dicts, or a `datasets.Dataset`), keeping the first `limit` errors.
    `source`: the file the records are, whole and in order; a JSON-lines file gives each error its line."""
    errors, num_bad, num_records, num_identical = [], 0, 0, 0
    for index, record in enumerate(_with_progress(records, source=source)):
        num_records += 1
        try:
            formatted = format_record(record, record_type=record_type, fields=fields, index=index)
            num_identical += record_type == "preference" and formatted["chosen"] == formatted["rejected"]
        except RecordError as error:
            num_bad += 1
            if len(errors) < limit:
                errors.append(error)
    lines = line_numbers(path=source, indices=[e.index for e in errors]) if source and errors else {}
    located = tuple(e.located(line=lines[e.index], source=source) if e.index in lines else e for e in errors)
    return RecordCheck(errors=located, num_bad=num_bad, num_records=num_records, num_identical=num_identical)


PROGRESS_MIN_RECORDS = 100_000  # below this a check takes about a second: no bar


def _with_progress(records, *, source: str | None):
    """`records`, with a progress bar on stderr when there are many (a large file takes minutes to check)."""
    total = len(records) if hasattr(records, "__len__") else 0
    if total < PROGRESS_MIN_RECORDS:
        return records
    import sys

    from tqdm import tqdm

    return tqdm(records, total=total, desc=f"checking {source or 'records'}", unit=" records", file=sys.stderr,
                mininterval=1.0)
