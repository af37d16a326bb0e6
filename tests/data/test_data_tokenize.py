"""tokenize_examples: exact token layouts for text documents, prompt/completion and chat masks (packing itself:
test_data_packing.py)."""

import pickle

import pytest
import torch
from data_helpers import EXAMPLES, SIMPLE_TEMPLATE, ids_of

from toolkit.data import assistant_spans, build_examples, load_records, tokenize_examples
from toolkit.data.packing import NoLossTokensError
from toolkit.errors import DsmtError
from toolkit.spec.schema import DataSpec

EOS = 2  # "</s>" in the tiny tokenizer; it has no pad token, so EOS pads too


def _examples(write_jsonl, cache_dir, tokenizer, rows, *, seq_length, **fields):
    data = DataSpec(path=write_jsonl(rows), **fields)
    records = load_records(data=data, cache_dir=cache_dir)
    return tokenize_examples(records=records, data=data, tokenizer=tokenizer, seq_length=seq_length)


def test_text_packs_whole_documents_with_eos(write_jsonl, cache_dir, tokenizer):
    a, b, c = (ids_of(tokenizer, t) for t in ("ab", "cde", "f"))
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"text": t} for t in ("ab", "cde", "f")], seq_length=3)
    # documents a b EOS | c d e EOS | f EOS in rows of seq_length + 1 = 4: the second does not fit after the first,
    # the third does not fit after the second; padding (EOS) fills each row, whose labels do not count
    assert examples.token_ids.tolist() == [a + [EOS, EOS], b + [EOS], c + [EOS, EOS, EOS]]
    assert examples.loss_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]] and examples.kind == "text"
    assert examples.position_ids.tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 0]]  # padding: its own segment
    assert examples.token_ids.dtype == torch.int64 and examples.seq_length == 3 and examples.num_records == 3


def test_text_of_only_eos_has_no_label(write_jsonl, cache_dir, tokenizer):
    with pytest.raises(DsmtError, match=r"none of the 1 text records has a loss-bearing token.*seq_length \+ 1 = 9"):
        _examples(write_jsonl, cache_dir, tokenizer, [{"text": ""}], seq_length=8)


def test_non_string_text_names_the_record(write_jsonl, cache_dir, tokenizer):
    with pytest.raises(DsmtError, match=r"record 2: field 'text' is NoneType"):
        _examples(write_jsonl, cache_dir, tokenizer, [{"text": "ab"}, {"text": None}], seq_length=2)


def test_prompt_completion_masks_exactly_the_completion(write_jsonl, cache_dir, tokenizer):
    rows = [{"q": "ab", "a": "c"}, {"q": "d", "a": "efg"}]
    examples = _examples(write_jsonl, cache_dir, tokenizer, rows, seq_length=5, prompt_field="q", completion_field="a")
    a, b, c, d, e, f, g = (ids_of(tokenizer, ch)[0] for ch in "abcdefg")
    assert examples.token_ids.tolist() == [[a, b, c, EOS, EOS, EOS], [d, e, f, g, EOS, EOS]]
    # loss_mask[t] is for labels[t] = ids[t + 1]: completion tokens and their EOS count, prompt and padding do not
    assert examples.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert examples.kind == "prompt_completion" and examples.num_dropped == 0


def test_prompt_completion_truncates_and_drops_records_without_loss(write_jsonl, cache_dir, tokenizer):
    rows = [{"q": "abcdefgh", "a": "x"}, {"q": "ab", "a": "cdefghij"}]
    examples = _examples(write_jsonl, cache_dir, tokenizer, rows, seq_length=4, prompt_field="q", completion_field="a")
    assert examples.num_dropped == 1 and examples.num_truncated == 2  # the long prompt leaves no completion
    assert examples.token_ids.tolist() == [ids_of(tokenizer, "abcde")]
    assert examples.loss_mask.tolist() == [[0, 1, 1, 1]]
    # no record left: the rule the dry run applies too, naming the prompt lengths and the seq_length that fits
    with pytest.raises(NoLossTokensError, match=r"^\[no_loss_tokens\] none of the 1 prompt_completion records .*"
                       r"seq_length \+ 1 = 5 tokens: their prompts are 8 tokens long; fix: raise training.seq_length "
                       r"to 9 \(every record whole; at least 8 trains") as refused:
        _examples(write_jsonl, cache_dir, tokenizer, rows[:1], seq_length=4, prompt_field="q", completion_field="a")
    assert str(pickle.loads(pickle.dumps(refused.value))) == str(refused.value)  # crosses worker processes whole


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"}, {"role": "assistant", "content": "no"}]


def test_chat_with_template_masks_assistant_turns(write_jsonl, cache_dir, tokenizer):
    tokenizer.chat_template = SIMPLE_TEMPLATE
    text, spans = assistant_spans(tokenizer=tokenizer, messages=CHAT, use_template=True)
    assert text == "<u>hi</u><a>yo</a><u>ok</u><a>no</a>"
    # Each assistant span starts after the generation prompt "<a>" and includes the end-of-turn marker "</a>".
    assert [text[s:e] for s, e in spans] == ["yo</a>", "no</a>"]
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"messages": CHAT}], seq_length=40,
                         messages_field="messages")
    assert examples.used_chat_template is True
    ids = examples.token_ids[0].tolist()
    assert ids[: len(text)] == ids_of(tokenizer, text) and ids[len(text):] == [EOS] * (41 - len(text))
    is_target = [any(s <= i < e for s, e in spans) for i in range(len(text))] + [False] * (41 - len(text))
    assert examples.loss_mask[0].tolist() == [float(t) for t in is_target[1:]]


def test_chat_without_template_uses_role_lines_and_eos(write_jsonl, cache_dir, tokenizer, caplog):
    assert not tokenizer.chat_template
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"messages": CHAT[:2]}], seq_length=24,
                         messages_field="messages")
    assert examples.used_chat_template is False and "no chat_template" in caplog.text
    text = "user: hi\nassistant: yo\n"
    expected = ids_of(tokenizer, text) + [EOS]
    assert examples.token_ids[0].tolist() == expected + [EOS] * (25 - len(expected))
    target = [0] * len("user: hi\nassistant: ") + [1] * len("yo\n") + [1]  # + the final EOS
    assert examples.loss_mask[0].tolist() == (target + [0] * (25 - len(target)))[1:]


def test_chat_bad_messages_name_the_record(write_jsonl, cache_dir, tokenizer):
    rows = [{"messages": CHAT[:2]}, {"messages": [{"role": "user", "content": None}]}]
    with pytest.raises(DsmtError, match=r"record 2: turn 0 of 'messages' has no 'content'"):
        _examples(write_jsonl, cache_dir, tokenizer, rows, seq_length=30, messages_field="messages")


def test_chat_template_that_rewrites_history_is_refused(tokenizer):
    # Renders only the last message: earlier renderings are not prefixes of later ones.
    tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(DsmtError, match=r"renders turn 1 differently"):
        assistant_spans(tokenizer=tokenizer, messages=CHAT, use_template=True)


def test_messages_and_prompt_fields_are_exclusive():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="exclusive"):
        DataSpec(messages_field="messages", prompt_field="q", completion_field="a")


def test_shipped_examples_tokenize_with_the_tiny_tokenizer(tiny_checkpoint, cache_dir):
    specs = [DataSpec(path=str(EXAMPLES / "tiny_stories.jsonl")),
             DataSpec(path=str(EXAMPLES / "tiny_prompts.jsonl"), prompt_field="prompt", completion_field="completion"),
             DataSpec(path=str(EXAMPLES / "tiny_chat.jsonl"), messages_field="messages")]
    for data in specs:
        examples = build_examples(data=data, model_path=str(tiny_checkpoint), seq_length=128, vocab_size=250, seed=0,
                                  cache_dir=cache_dir)
        assert examples.num_records >= 40 and examples.loss_mask.sum() > 0
    with pytest.raises(DsmtError, match=r"id \d+ but the model's vocab_size is 20"):
        build_examples(data=specs[0], model_path=str(tiny_checkpoint), seq_length=64, vocab_size=20, seed=0,
                       cache_dir=cache_dir)
