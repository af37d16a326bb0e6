"""data.packing: records packed whole into rows with per-record positions and masked crossing labels, or one
record per row; the long-record policy; position ids through the cache and the micro-batches."""

import torch
from data_helpers import ids_of

from toolkit.data import MicroBatches, load_records, open_cache, tokenize_examples
from toolkit.data.cache import FORMAT_VERSION, write_cache
from toolkit.spec.schema import DataSpec

EOS = 2  # the tiny tokenizer's EOS, which also pads


def _examples(write_jsonl, cache_dir, tokenizer, rows, *, seq_length, name="data.jsonl", **fields):
    data = DataSpec(path=write_jsonl(rows, name=name), **fields)
    records = load_records(data=data, cache_dir=cache_dir)
    return tokenize_examples(records=records, data=data, tokenizer=tokenizer, seq_length=seq_length)


def test_packed_rows_restart_positions_and_mask_crossing_labels(write_jsonl, cache_dir, tokenizer):
    texts = ["ab", "c", "de", "fgh"]  # documents of 3, 2, 3 and 4 tokens with their EOS
    a, b, c, d = (ids_of(tokenizer, t) + [EOS] for t in texts)
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"text": t} for t in texts], seq_length=7)
    # rows of 8: [ab EOS | c EOS | de EOS] fills 8; [fgh EOS] + 4 padding
    assert examples.token_ids.tolist() == [a + b + c, d + [EOS] * 4]
    # label t is token t + 1: the labels from the last token of a record to the next record's first are masked
    assert examples.loss_mask.tolist() == [[1, 1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0]]
    assert examples.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]]
    assert examples.num_records == 4 and examples.num_split == 0


def test_unpacked_rows_hold_one_record_with_plain_positions(write_jsonl, cache_dir, tokenizer):
    texts = ["ab", "c", "de"]
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"text": t} for t in texts], seq_length=4,
                         packing=False)
    assert examples.token_ids.tolist() == [ids_of(tokenizer, t) + [EOS] * (5 - len(t)) for t in texts]
    assert examples.loss_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert examples.position_ids.tolist() == [[0, 1, 2, 3]] * 3  # no boundary: the model's plain causal path


def test_each_record_counts_its_own_labels_packed_or_not(write_jsonl, cache_dir, tokenizer):
    texts = ["a", "bc", "defg", "hi", "jklmn", "o", "pq"]
    counts = {}
    for packing in (True, False):
        examples = _examples(write_jsonl, cache_dir, tokenizer, [{"text": t} for t in texts], seq_length=9,
                             packing=packing)
        counts[packing] = (len(examples), int(examples.loss_mask.sum()))
    # a document of L tokens (EOS included) has L - 1 labels: its characters
    assert counts[True][1] == counts[False][1] == sum(len(t) for t in texts)
    assert counts[True][0] < counts[False][0] == len(texts)


def test_prompt_completion_records_pack_with_their_targets(write_jsonl, cache_dir, tokenizer):
    rows = [{"q": "ab", "a": "c"}, {"q": "d", "a": "e"}, {"q": "fg", "a": "hij"}]
    examples = _examples(write_jsonl, cache_dir, tokenizer, rows, seq_length=8, prompt_field="q",
                         completion_field="a")
    a, b, c, d, e, f, g, h, i, j = (ids_of(tokenizer, ch)[0] for ch in "abcdefghij")
    assert examples.token_ids.tolist() == [[a, b, c, EOS, d, e, EOS, EOS, EOS], [f, g, h, i, j, EOS, EOS, EOS, EOS]]
    # completion tokens and their EOS count; prompts, the crossing label (EOS -> d) and padding do not
    assert examples.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]]
    assert examples.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 1]]


def test_long_text_is_split_and_long_prompt_completion_truncated(write_jsonl, cache_dir, tokenizer):
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"text": "abcdefgh"}, {"text": "xy"}], seq_length=3)
    # 9 tokens -> pieces abcd | efgh | EOS: the last has no label and is dropped; "xy EOS" packs alone
    assert examples.token_ids.tolist() == [ids_of(tokenizer, "abcd"), ids_of(tokenizer, "efgh"),
                                           ids_of(tokenizer, "xy") + [EOS, EOS]]
    assert examples.num_split == 1 and examples.num_records == 3 and examples.num_truncated == 0
    assert examples.loss_mask.sum() == 3 + 3 + 2  # each piece is its own document
    assert "1 documents split into pieces of seq_length + 1" in examples.describe()
    sft = _examples(write_jsonl, cache_dir, tokenizer, [{"q": "ab", "a": "cdefgh"}], seq_length=3,
                    prompt_field="q", completion_field="a", name="sft.jsonl")
    assert sft.token_ids.tolist() == [ids_of(tokenizer, "abcd")] and sft.num_truncated == 1 and sft.num_split == 0
    assert "1 records truncated" in sft.describe()


def test_position_ids_survive_the_cache_and_reach_the_micro_batches(write_jsonl, cache_dir, tokenizer, tmp_path):
    texts = ["ab", "c", "de", "fgh", "i", "jk"]
    examples = _examples(write_jsonl, cache_dir, tokenizer, [{"text": t} for t in texts], seq_length=7)
    meta = write_cache(directory=tmp_path / "key", examples=examples, inputs={"format_version": FORMAT_VERSION})
    cached = open_cache(tmp_path / "key")
    assert FORMAT_VERSION >= 2 and meta["num_records"] == 6
    assert torch.equal(cached.position_ids, examples.position_ids) and cached.num_records == examples.num_records
    batches = MicroBatches(examples=cached, micro_batch_size=len(cached), num_microbatches=1, dp_rank=0, dp_size=1,
                           seed=0, shuffle=False).batches_for_step(0)
    assert batches[0]["position_ids"].dtype == torch.int64
    assert torch.equal(batches[0]["position_ids"], examples.position_ids.long())


def test_packing_changes_the_cache_key(tokenizer, write_jsonl):
    from toolkit.data.cache import cache_key

    path = write_jsonl([{"text": "ab"}])
    keys = {p: cache_key(data=DataSpec(path=path, packing=p), tokenizer=tokenizer, seq_length=8)[0]
            for p in (True, False)}
    assert keys[True] != keys[False]
