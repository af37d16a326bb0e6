"""Preference records (data.type: preference) -> pairs: formatting, exact rows for packed and unpacked pairs, the
truncation rules, dropped and identical pairs, the cache round trip, PreferenceBatches and the check paths."""

from types import SimpleNamespace

import pytest
import torch
from data_helpers import SIMPLE_TEMPLATE, ids_of

from toolkit.data import (MicroBatches, PreferenceBatches, PreferenceError, PreferenceExamples, job_rows,
                          load_records, open_cache, tokenize_examples)
from toolkit.data.cache import write_cache
from toolkit.data.formats import RecordError, RecordFields, check_records, format_record
from toolkit.data.packing import NoLossTokensError
from toolkit.data.records import required_fields
from toolkit.spec.schema import DataSpec

EOS = 2  # "</s>" in the tiny tokenizer; it has no pad token, so EOS pads too
USER, ASSISTANT = "user", "assistant"


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _pairs(write_jsonl, cache_dir, tokenizer, rows, *, seq_length: int, packing: bool) -> PreferenceExamples:
    data = DataSpec(path=write_jsonl(rows), type="preference", packing=packing)
    return tokenize_examples(records=load_records(data=data, cache_dir=cache_dir), data=data, tokenizer=tokenizer,
                             seq_length=seq_length)


def _ids(tokenizer, text: str) -> list[int]:
    """`text` in the tiny tokenizer's ids, "E" standing for EOS (its characters are one token each)."""
    return [EOS if ch == "E" else ids_of(tokenizer, ch)[0] for ch in text]


# --- formatting -------------------------------------------------------------------------------------------------

def _format(record, index=0) -> dict:
    return format_record(record, record_type="preference", fields=RecordFields(), index=index)


def _format_error(record) -> RecordError:
    with pytest.raises(RecordError) as caught:
        _format(record)
    return caught.value


def test_string_and_conversational_forms_format_to_three_fields():
    assert _format({"prompt": "p", "chosen": "c", "rejected": "r", "id": 3}) == {"prompt": "p", "chosen": "c",
                                                                                 "rejected": "r"}
    prompt, chosen, rejected = [_msg(USER, "hi")], [_msg(ASSISTANT, "yo")], [_msg(ASSISTANT, "no")]
    explicit = _format({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    assert explicit == {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    # implicit: the messages both sides open with are the prompt (a `datasets` turn holds None for absent keys)
    implicit = _format({"chosen": prompt + chosen, "rejected": [{**prompt[0], "name": None}] + rejected})
    assert implicit == explicit
    assert required_fields(DataSpec(type="preference")) == ["chosen", "rejected"]


def test_an_implicit_prompt_leaves_each_side_its_last_message():
    """TRL's extract_prompt: equal sides, or one a prefix of the other, stay a pair (of identical or longer
    completions); only a file of identical pairs is refused (rule preference_identical)."""
    turns = [_msg(USER, "q"), _msg(ASSISTANT, "a")]
    same = _format({"chosen": turns, "rejected": list(turns)})
    assert same == {"prompt": turns[:1], "chosen": turns[1:], "rejected": turns[1:]}
    longer = _format({"chosen": turns + [_msg(USER, "more"), _msg(ASSISTANT, "b")], "rejected": turns})
    assert longer["prompt"] == turns[:1] and len(longer["chosen"]) == 3 and longer["rejected"] == turns[1:]


@pytest.mark.parametrize("record, rule, message", [
    ({"prompt": "p", "rejected": "r"}, "record_missing_field", "record 1: no field 'chosen' (fields present: "
                                                               "prompt, rejected)"),
    ({"chosen": "c", "rejected": "r"}, "record_missing_field", "record 1: no field 'prompt' (chosen and rejected "
                                                               "are strings"),
    ({"prompt": "p", "chosen": "c", "rejected": [_msg(ASSISTANT, "r")]}, "record_field_type",
     "record 1: field 'rejected' is list"),
    ({"prompt": "p", "chosen": [_msg(ASSISTANT, "c")], "rejected": [_msg(ASSISTANT, "r")]}, "record_field_type",
     "record 1: field 'prompt' is str ('p') but 'chosen' is list"),
    ({"prompt": "p", "chosen": 3, "rejected": "r"}, "record_field_type", "field 'chosen' is int (3), expected str "
                                                                         "or a list of messages"),
    ({"chosen": [_msg(USER, "a")], "rejected": [_msg(USER, "b")]}, "record_empty",
     "chosen and rejected share no first message, so the record has no prompt"),
    ({"prompt": [], "chosen": [_msg(ASSISTANT, "c")], "rejected": [_msg(ASSISTANT, "r")]}, "record_empty",
     "field 'prompt' is an empty list"),
    ({"prompt": [_msg(USER, "a")], "chosen": [], "rejected": [_msg(ASSISTANT, "r")]}, "record_empty",
     "field 'chosen' is an empty list"),
    ({"prompt": [], "chosen": [{"role": "bot", "content": "c"}], "rejected": [_msg(ASSISTANT, "r")]},
     "record_unknown_role", "turn 0 of 'chosen' has role 'bot'"),
])
def test_bad_records_name_the_rule_and_the_fix(record, rule, message):
    error = _format_error(record)
    assert error.rule == rule and message in str(error)


def test_check_records_counts_identical_pairs():
    records = [{"prompt": "p", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "a", "rejected": "b"}]
    checked = check_records(records, record_type="preference", fields=RecordFields())
    assert checked.ok and checked.num_identical == 1


# --- tokenisation and rows ----------------------------------------------------------------------------------------

STRING_ROWS = [{"prompt": "ab", "chosen": "cd", "rejected": "e"}, {"prompt": "xyz", "chosen": "q", "rejected": "rs"}]


def test_string_pairs_packed(write_jsonl, cache_dir, tokenizer):
    examples = _pairs(write_jsonl, cache_dir, tokenizer, STRING_ROWS, seq_length=8, packing=True)
    assert len(examples) == 2 and examples.rows_per_pair == 1 and examples.seq_length == 8
    # pair 1: c = 2 + 3 = 5, so each prompt keeps (9 - 5) // 2 = 2 of its 3 tokens: "yz"
    assert examples.token_ids.tolist() == [_ids(tokenizer, "abcdEabeE"), _ids(tokenizer, "yzqEyzrsE")]
    # labels ids[1:]: completions and their EOS count; the label crossing into the rejected side does not
    assert examples.loss_mask.tolist() == [[0, 1, 1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 1, 1, 1]]
    assert examples.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert examples.sequence.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]]
    assert (examples.num_truncated, examples.num_dropped, examples.num_records) == (1, 0, 2)
    assert examples.counted_tokens() == 10 and examples.kind == "preference" and examples.used_chat_template is None
    assert "2 preference pairs (chosen then rejected in one row) in 2 rows of 9 ids" in examples.describe()


def test_string_pairs_unpacked_and_the_micro_batch(write_jsonl, cache_dir, tokenizer):
    examples = _pairs(write_jsonl, cache_dir, tokenizer, STRING_ROWS, seq_length=8, packing=False)
    assert len(examples) == 2 and examples.rows_per_pair == 2 and examples.num_truncated == 0
    assert examples.token_ids.tolist() == [_ids(tokenizer, text) for text in
                                           ("abcdEEEEE", "abeEEEEEE", "xyzqEEEEE", "xyzrsEEEE")]
    assert examples.loss_mask.tolist() == [[0, 1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0],
                                           [0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]]
    assert examples.position_ids.tolist() == [list(range(8))] * 4
    assert examples.sequence.tolist() == [[0] * 8, [0, 1, 1, 0, 0, 0, 0, 0], [0] * 8, [0, 0, 1, 1, 1, 0, 0, 0]]
    batch = examples.pair_rows(torch.tensor([1, 0]))
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        **{k: ((4, 8), torch.int64) for k in ("tokens", "labels", "position_ids", "sequence_index")},
        "loss_mask": ((4, 8), torch.float32), "pair_mask": ((2,), torch.float32), "pair_index": ((2,), torch.int64)}
    assert batch["tokens"].tolist() == [row[:-1] for row in examples.token_ids[[2, 3, 0, 1]].tolist()]
    assert batch["labels"].tolist() == [row[1:] for row in examples.token_ids[[2, 3, 0, 1]].tolist()]
    # 2 * j + side for pair j of the micro-batch, 0 where the label does not count
    assert batch["sequence_index"].tolist() == [[0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0],
                                                [0, 2, 2, 2, 0, 0, 0, 0], [0, 3, 3, 0, 0, 0, 0, 0]]
    assert batch["pair_mask"].tolist() == [1, 1] and batch["pair_index"].tolist() == [1, 0]


CONVERSATION = {"prompt": [_msg(USER, "hi"), _msg(ASSISTANT, "ok"), _msg(USER, "go")],
                "chosen": [_msg(ASSISTANT, "yo")], "rejected": [_msg(ASSISTANT, "no!")]}


def test_conversational_pairs_learn_only_the_completion_turns(write_jsonl, cache_dir, tokenizer):
    tokenizer.chat_template = SIMPLE_TEMPLATE
    implicit = {"chosen": CONVERSATION["prompt"] + CONVERSATION["chosen"],
                "rejected": CONVERSATION["prompt"] + CONVERSATION["rejected"]}
    explicit, from_implicit = (_pairs(write_jsonl, cache_dir, tokenizer, [row], seq_length=40, packing=False)
                               for row in (CONVERSATION, implicit))
    assert explicit.used_chat_template is True
    assert torch.equal(explicit.token_ids, from_implicit.token_ids)
    assert torch.equal(explicit.loss_mask, from_implicit.loss_mask)
    prompt = "<u>hi</u><a>ok</a><u>go</u><a>"  # the generation prompt is the prompt's; "ok</a>" is not learned
    for row, completion in zip(explicit.token_ids.tolist(), ("yo</a>", "no!</a>")):
        text = prompt + completion
        assert row == ids_of(tokenizer, text) + [EOS] * (41 - len(text))  # the template ends turns: no EOS added
    assert explicit.loss_mask.tolist() == [[0.0] * (len(prompt) - 1) + [1.0] * 6 + [0.0] * (41 - len(prompt) - 6),
                                           [0.0] * (len(prompt) - 1) + [1.0] * 7 + [0.0] * (41 - len(prompt) - 7)]


def test_conversational_fallback_ends_the_reply_with_eos(write_jsonl, cache_dir, tokenizer):
    row = {"prompt": [_msg(USER, "hi")], "chosen": [_msg(ASSISTANT, "yo")], "rejected": [_msg(ASSISTANT, "n")]}
    examples = _pairs(write_jsonl, cache_dir, tokenizer, [row], seq_length=50, packing=True)
    assert examples.used_chat_template is False
    chosen, rejected = "user: hi\nassistant: yo\n", "user: hi\nassistant: n\n"
    whole = ids_of(tokenizer, chosen) + [EOS] + ids_of(tokenizer, rejected) + [EOS]
    assert examples.token_ids[0].tolist() == whole + [EOS] * (51 - len(whole))
    prompt = len("user: hi\nassistant: ")
    target = [0] * prompt + [1] * 4 + [0] * prompt + [1] * 3  # "yo\n" + EOS; "n\n" + EOS
    assert examples.loss_mask[0].tolist() == (target + [0] * (51 - len(target)))[1:]
    assert examples.sequence[0].tolist()[len(chosen) + 1:len(whole) - 1] == [0] * (prompt - 1) + [1] * 3


def test_unpacked_truncation_cuts_prompts_from_the_left_alike_then_completions(write_jsonl, cache_dir, tokenizer):
    # L = 8: the longer completion "ijklE" leaves 3 prompt tokens to both sides
    examples = _pairs(write_jsonl, cache_dir, tokenizer, [{"prompt": "abcdef", "chosen": "gh", "rejected": "ijkl"}],
                      seq_length=7, packing=False)
    assert examples.token_ids.tolist() == [_ids(tokenizer, "defghEEE"), _ids(tokenizer, "defijklE")]
    assert examples.num_truncated == 1
    # L = 6: a completion longer than L keeps one prompt token and is cut at the right
    examples = _pairs(write_jsonl, cache_dir, tokenizer, [{"prompt": "ab", "chosen": "cdefghij", "rejected": "k"}],
                      seq_length=5, packing=False)
    assert examples.token_ids.tolist() == [_ids(tokenizer, "bcdefg"), _ids(tokenizer, "bkEEEE")]
    assert examples.loss_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0]]


def test_packed_truncation_shares_the_row(write_jsonl, cache_dir, tokenizer):
    # L = 10, completions 7 + 3: one prompt token each, then A = 8: the shorter keeps its 3, the longer 5
    examples = _pairs(write_jsonl, cache_dir, tokenizer, [{"prompt": "abcd", "chosen": "efghij", "rejected": "kl"}],
                      seq_length=9, packing=True)
    assert examples.token_ids.tolist() == [_ids(tokenizer, "defghidklE")]
    assert examples.loss_mask.tolist() == [[1, 1, 1, 1, 1, 0, 1, 1, 1]]
    assert examples.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2]]
    assert examples.sequence.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, 1]] and examples.num_truncated == 1
    # both completions long: A = 8 split 4 / 4 (chosen counts as the shorter on a tie)
    examples = _pairs(write_jsonl, cache_dir, tokenizer, [{"prompt": "ab", "chosen": "cdefgh", "rejected": "ijklmn"}],
                      seq_length=9, packing=True)
    assert examples.token_ids.tolist() == [_ids(tokenizer, "bcdefbijkl")]


def test_pairs_without_a_label_on_a_side_are_dropped(write_jsonl, cache_dir, tokenizer):
    tokenizer.chat_template = SIMPLE_TEMPLATE
    prompt = [_msg(USER, "hi")]
    rows = [{"prompt": prompt, "chosen": [_msg(USER, "more")], "rejected": [_msg(ASSISTANT, "no")]},  # no reply
            {"prompt": prompt, "chosen": [_msg(ASSISTANT, "yes")], "rejected": [_msg(ASSISTANT, "no")]}]
    examples = _pairs(write_jsonl, cache_dir, tokenizer, rows, seq_length=20, packing=True)
    assert (len(examples), examples.num_dropped, examples.num_records) == (1, 1, 1)
    assert "1 pairs dropped" in examples.describe()
    with pytest.raises(NoLossTokensError, match=r"none of the 1 preference pairs .* at any length; fix: give every "
                                                r"side a completion"):
        _pairs(write_jsonl, cache_dir, tokenizer, rows[:1], seq_length=20, packing=True)


def test_identical_pairs_are_refused_when_every_pair_is(write_jsonl, cache_dir, tokenizer):
    same = [{"prompt": "ab", "chosen": "cd", "rejected": "cd"}] * 2
    with pytest.raises(PreferenceError, match=r"^\[preference_identical\] all 2 preference pairs .* chosen == "
                                              r"rejected") as refused:
        _pairs(write_jsonl, cache_dir, tokenizer, same, seq_length=8, packing=False)
    assert refused.value.rule == "preference_identical"
    assert len(_pairs(write_jsonl, cache_dir, tokenizer, same + STRING_ROWS[:1], seq_length=8, packing=False)) == 3


# --- cache, batches, job rows ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("packing", [True, False])
def test_cache_round_trip(write_jsonl, cache_dir, tokenizer, tmp_path, packing):
    examples = _pairs(write_jsonl, cache_dir, tokenizer, STRING_ROWS, seq_length=8, packing=packing)
    meta = write_cache(directory=tmp_path / "key", examples=examples, inputs={"test": 1})
    assert (meta["num_pairs"], meta["rows_per_pair"], meta["kind"]) == (2, 1 if packing else 2, "preference")
    opened = open_cache(tmp_path / "key")
    assert isinstance(opened, PreferenceExamples) and opened.directory == tmp_path / "key"
    for name in ("token_ids", "loss_mask", "position_ids", "sequence"):
        assert torch.equal(getattr(opened, name), getattr(examples, name)), name
    assert (opened.rows_per_pair, opened.num_truncated, opened.num_records) == (
        examples.rows_per_pair, examples.num_truncated, examples.num_records)
    assert all(torch.equal(a, b) for a, b in zip(opened.pair_rows([1, 0]).values(),
                                                 examples.pair_rows([1, 0]).values()))


def _numbered_pairs(num_pairs: int) -> PreferenceExamples:
    """Pair k's rows hold ids k*100 + 0..4, so a row names the pair it came from."""
    ids = (torch.arange(num_pairs)[:, None] * 100 + torch.arange(5)).repeat_interleave(2, dim=0)
    zeros = torch.zeros(2 * num_pairs, 4)
    return PreferenceExamples(token_ids=ids, loss_mask=zeros + 1, position_ids=zeros.to(torch.int32),
                              sequence=zeros.to(torch.int8), rows_per_pair=2)


def test_preference_batches_follow_the_micro_batch_rule():
    examples = _numbered_pairs(7)
    layout = dict(micro_batch_size=2, num_microbatches=2, dp_size=2, seed=3)
    for rank in range(2):
        pairs = PreferenceBatches(examples=examples, dp_rank=rank, **layout)
        rows = MicroBatches(examples=examples, dp_rank=rank, **layout)
        for step in range(3):  # 8 pairs a step from 7: steps straddle epochs
            for batch, expected in zip(pairs.batches_for_step(step), rows.rank_sample_indices(step=step)):
                assert batch["pair_index"].tolist() == expected.tolist()
                assert (batch["tokens"][:, 0] // 100).tolist() == expected.repeat_interleave(2).tolist()
            assert pairs.global_batch_for_step(step)["pair_index"].tolist() == \
                rows.global_sample_indices(step=step).tolist()


def test_job_rows_refuses_preference_pairs_from_a_mix_or_synthetic_tokens(tmp_path):
    mix = DataSpec(mix=[{"path": "a.jsonl", "weight": 1.0, "type": "preference"},
                        {"path": "b.jsonl", "weight": 1.0}])
    with pytest.raises(PreferenceError, match=r"^\[preference_source\] data.type=preference in data.mix\[0\] with "
                                              r"data.mix"):
        job_rows(data=mix, model_path=None, seq_length=8, vocab_size=256, seed=0, output_dir=tmp_path)
    with pytest.raises(PreferenceError, match=r"preference_source.*data.synthetic=true"):
        job_rows(data=DataSpec(type="preference", synthetic=True), model_path=None, seq_length=8, vocab_size=256,
                 seed=0, output_dir=tmp_path)


# --- dsmt check and the dry run -----------------------------------------------------------------------------------

def test_check_reports_bad_records_by_line_and_identical_pairs(write_jsonl):
    from toolkit.check.data_checks import record_problems

    path = write_jsonl([{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p", "rejected": "r"}])
    [problem] = record_problems(label="data", data=DataSpec(path=path, type="preference"))
    assert problem.rule == "record_missing_field" and "record 2 (line 2 of" in problem.message
    path = write_jsonl([{"prompt": "p", "chosen": "c", "rejected": "c"}] * 3, name="same.jsonl")
    [problem] = record_problems(label="data", data=DataSpec(path=path, type="preference"))
    assert (problem.severity, problem.rule) == ("error", "preference_identical")
    assert "all 3 preference pairs" in problem.message and "differ" in problem.fix


def test_dry_run_describes_pairs(write_jsonl, cache_dir, tokenizer):
    from toolkit.check.dryrun_data import record_length_problems

    spec = SimpleNamespace(training=SimpleNamespace(seq_length=8))
    data = DataSpec(path=write_jsonl(STRING_ROWS), type="preference")
    records = load_records(data=data, cache_dir=cache_dir)
    [problem] = record_length_problems(spec=spec, label="data", data=data, records=records, tokenizer=tokenizer)
    assert problem.rule == "data_rows" and "2 preference pairs" in problem.message
    same = DataSpec(path=write_jsonl([{"prompt": "p", "chosen": "c", "rejected": "c"}], name="same.jsonl"),
                    type="preference")
    [problem] = record_length_problems(spec=spec, label="data", data=same, tokenizer=tokenizer,
                                       records=load_records(data=same, cache_dir=cache_dir))
    assert (problem.severity, problem.rule) == ("error", "preference_identical")


def test_a_token_overlapping_a_reply_is_the_replys():
    """Byte-level BPE joins the space ending the fallback's 'assistant: ' to the reply's first word: the token
    ' Yes' starts one character before the reply's span and is its first label all the same."""
    from types import SimpleNamespace

    from toolkit.data.encoding import single_bos, span_targets

    text = "user: q\nassistant: Yes\n"
    reply = (text.index("Yes"), len(text))
    offsets = [(0, 4), (4, 5), (5, 7), (7, 8), (8, 17), (17, 18), (18, 22), (22, 23), (0, 0)]  # ' Yes' = (18, 22)
    assert span_targets(offsets, [reply]) == [0, 0, 0, 0, 0, 0, 1, 1, 0]
    tokenizer = SimpleNamespace(bos_token_id=1)
    assert single_bos([1, 1, 5], tokenizer=tokenizer) == [1, 5] and single_bos([1, 5], tokenizer=tokenizer) == [1, 5]
