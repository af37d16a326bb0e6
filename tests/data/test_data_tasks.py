"""toolkit/data/tasks.py: task from the architecture, masked-LM masking (statistics, determinism, HF's own rule),
classification / regression labels and their named errors, the DP sample order of TaskBatches."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from toolkit.data.labels import LabelFieldMissingError, LabelTypeError, NumLabelsMismatchError
from toolkit.data.tasks import TaskBatches, UnsupportedTaskError, mlm_row_seed, task_examples, task_of
from toolkit.spec.schema import DataSpec

WORDS = "the a cat dog sat on mat ran fast slow big small red blue green house tree bird sky sun".split()
SEQ = 16


def distilbert_dir(root: Path, *, head: str, **config) -> Path:
    """A tiny DistilBERT with `head` (MaskedLM / SequenceClassification) and a word-level BERT vocabulary."""
    import transformers

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tokenizer = transformers.DistilBertTokenizer(vocab=vocab)
    settings = dict(vocab_size=len(vocab), dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=32)
    model = getattr(transformers, f"DistilBertFor{head}")(transformers.DistilBertConfig(**settings, **config))
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def sentences(count: int, *, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 24))) for _ in range(count)]


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory):
    return distilbert_dir(tmp_path_factory.mktemp("mlm"), head="MaskedLM")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return distilbert_dir(tmp_path_factory.mktemp("cls"), head="SequenceClassification", num_labels=3)


def config_of(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def examples_for(model_dir, rows, tmp_path, **data):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return task_examples(data=DataSpec(path=str(path), **data), model_config=config_of(model_dir),
                         tokenizer_path=str(model_dir), seq_length=SEQ, seed=3, cache_dir=str(tmp_path / "cache"))


def test_task_from_the_architecture_and_unsupported_heads_named():
    from transformers import BertConfig

    assert task_of(BertConfig(architectures=["RobertaForMaskedLM"])) == "masked_lm"
    assert task_of(BertConfig(architectures=["GPT2LMHeadModel"])) == "causal_lm"
    assert task_of(BertConfig(architectures=["ResNetForImageClassification"])) == "image_classification"
    with pytest.raises(UnsupportedTaskError) as err:
        task_of(BertConfig(architectures=["BertForQuestionAnswering"]))
    message = str(err.value)
    assert "BertForQuestionAnswering" in message and "*ForMaskedLM" in message and "*LMHeadModel" in message


def test_masked_lm_masks_as_hf_collator_per_row_seeded_by_position(mlm_dir, tmp_path):
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    examples = examples_for(mlm_dir, [{"text": t} for t in sentences(400)], tmp_path)
    positions = torch.arange(1000, 1400)
    batch = examples.batch(indices=torch.arange(400), positions=positions)
    again = examples.batch(indices=torch.arange(400), positions=positions)
    assert all(torch.equal(batch[k], again[k]) for k in batch)  # a pure function of (seed, g)
    other_epoch = examples.batch(indices=torch.arange(400), positions=positions + 400)
    assert not torch.equal(other_epoch["labels"], batch["labels"])  # new masks when g changes

    original = examples.input_ids
    eligible = (examples.special_tokens_mask == 0)
    selected = batch["labels"] != -100
    assert not (selected & ~eligible).any()  # never [CLS], [SEP] or padding
    assert torch.equal(batch["labels"][selected], original[selected])
    rate = selected.sum() / eligible.sum()
    replaced = (batch["input_ids"] == 4) & selected
    unchanged = (batch["input_ids"] == original) & selected
    print(f"selected {rate:.3f}, [MASK] {replaced.sum() / selected.sum():.3f}, "
          f"unchanged {unchanged.sum() / selected.sum():.3f} of {int(eligible.sum())} eligible tokens")
    assert 0.13 < rate < 0.17
    assert 0.76 < replaced.sum() / selected.sum() < 0.84
    assert 0.07 < unchanged.sum() / selected.sum() < 0.15  # 10% kept + random ids that drew the same token

    # row 7 equals HF's collator with its generator seeded by the documented rule
    collator = DataCollatorForLanguageModeling(tokenizer=AutoTokenizer.from_pretrained(mlm_dir), mlm=True)
    collator.generator = torch.Generator().manual_seed(mlm_row_seed(seed=3, position=1007))
    ids, labels = collator.torch_mask_tokens(original[7][None].clone(),
                                             special_tokens_mask=examples.special_tokens_mask[7][None])
    assert torch.equal(ids[0], batch["input_ids"][7]) and torch.equal(labels[0], batch["labels"][7])


def test_text_rows_are_padded_truncated_and_have_the_tokenizers_keys(classifier_dir, tmp_path):
    rows = [{"text": "the cat sat", "label": 2}, {"text": " ".join(["dog"] * 40), "label": 0}]
    batch = examples_for(classifier_dir, rows, tmp_path).batch(indices=torch.tensor([0, 1]),
                                                               positions=torch.tensor([0, 1]))
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]  # DistilBERT's tokenizer: no token_type_ids
    assert batch["input_ids"].shape == (2, SEQ) and batch["attention_mask"][0].tolist() == [1] * 5 + [0] * 11
    assert batch["input_ids"][0, 5:].eq(0).all() and batch["attention_mask"][1].all()  # [PAD] is 0; row 1 cut
    assert batch["labels"].tolist() == [2, 0] and batch["labels"].dtype == torch.int64


def test_regression_targets_are_floats_and_names_map_through_label2id(tmp_path):
    regression = distilbert_dir(tmp_path / "reg", head="SequenceClassification", num_labels=1)
    examples = examples_for(regression, [{"text": "the cat", "score": 1}, {"text": "a dog", "score": -0.5}],
                            tmp_path, label_field="score")
    assert examples.labels.dtype == torch.float32 and examples.labels.tolist() == [1.0, -0.5]
    named = distilbert_dir(tmp_path / "named", head="SequenceClassification", num_labels=2,
                           id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1})
    examples = examples_for(named, [{"text": "the cat", "label": "pos"}, {"text": "a dog", "label": "neg"}], tmp_path)
    assert examples.labels.tolist() == [1, 0]


@pytest.mark.parametrize("rows, data, error, expected", [
    ([{"text": "the cat"}], {}, LabelFieldMissingError,
     ["record 1", "no field 'label'", "fields found: text", "data.label_field"]),
    ([{"text": "the cat", "label": 1}, {"text": "a dog"}], {}, LabelFieldMissingError,
     ["record 2", "'label'", "fields found: text, label"]),
    ([{"text": "the cat", "label": 1.5}, {"text": "a dog", "label": 0.5}], {}, LabelTypeError,
     ["record 1", "label=1.5 is float", "int class id"]),
    ([{"text": "the cat", "label": "pos"}], {}, LabelTypeError, ["'pos' is str", "label2id"]),
    ([{"text": "the cat", "label": 4}, {"text": "a dog", "label": 0}], {}, NumLabelsMismatchError,
     ["{0, 4}", "num_labels=3", "num_labels=5"]),
])
def test_bad_labels_are_named_errors(classifier_dir, tmp_path, rows, data, error, expected):
    with pytest.raises(error) as err:
        examples_for(classifier_dir, rows, tmp_path, **data)
    for text in expected:
        assert text in str(err.value), (text, str(err.value))
    assert err.value.exit_code == 2


def test_task_batches_split_the_global_batch_over_ranks_and_micro_batches(mlm_dir, tmp_path):
    examples = examples_for(mlm_dir, [{"text": t} for t in sentences(10)], tmp_path)
    common = dict(examples=examples, micro_batch_size=2, seed=5, shuffle=True)
    ranks = [TaskBatches(num_microbatches=2, dp_rank=r, dp_size=2, **common) for r in range(2)]
    single = TaskBatches(num_microbatches=4, dp_rank=0, dp_size=1, **common)
    for step in (0, 1, 2):  # 10 examples, 8 per step: steps 1 and 2 straddle epochs
        per_rank = [b.batches_for_step(step) for b in ranks]
        in_order = [per_rank[r][m] for m in range(2) for r in range(2)]
        joined = {k: torch.cat([mb[k] for mb in in_order]) for k in in_order[0]}
        expected = single.global_batch_for_step(step)
        assert joined.keys() == expected.keys() and all(torch.equal(joined[k], expected[k]) for k in joined)
        assert torch.equal(torch.cat([mb["input_ids"] for mb in single.batches_for_step(step)]),
                           expected["input_ids"])
    first_epoch = single.global_sample_indices(step=0).tolist()
    assert first_epoch == torch.randperm(10, generator=torch.Generator().manual_seed(5))[:8].tolist()


def test_causal_lm_windows_label_every_token(tmp_path):
    from toolkit.models.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "llama")
    examples = examples_for(model_dir, [{"text": t} for t in sentences(20)], tmp_path)
    batch = examples.batch(indices=torch.tensor([0, 1]), positions=torch.tensor([0, 1]))
    assert batch["input_ids"].shape == (2, SEQ) and torch.equal(batch["labels"], batch["input_ids"])
    assert batch["attention_mask"].all()
