"""The data section's rules (toolkit/spec/data_schema.py): one source, fields that fit the record type, Megatron
corpora's constraints; a resolved spec (every field written out) loads back."""

import pytest
from pydantic import ValidationError

from toolkit.spec.data_schema import DataSpec, data_sources


@pytest.mark.parametrize("fields, rule, needle", [
    ({"path": "a.jsonl", "blend": [[1, "c"]]}, "data_sources_exclusive", "data.path='a.jsonl' and data.blend"),
    ({"path": "a.jsonl", "mix": [{"path": "b", "weight": 1}]}, "data_sources_exclusive", "data.mix"),
    ({"path": "a.jsonl", "type": "alpaca", "text_field": "body"}, "type_fields", "does not read text_field"),
    ({"path": "a.jsonl", "type": "sharegpt", "prompt_field": "q", "completion_field": "a"}, "type_fields",
     "prompt_field"),
    ({"path": "corpus", "format": "megatron", "type": "alpaca"}, "megatron_type", "corpus of token ids"),
    ({"path": "corpus", "format": "megatron", "validation_path": "v.jsonl"}, "megatron_validation_path",
     "use data.validation_fraction"),
    ({"blend": [[0, "c"]]}, "blend_entry", "weight > 0"),
    ({"blend": []}, "blend_entry", "empty"),
    ({"mix": []}, "mix_empty", "data.mix is empty"),
    ({"mix": [{"path": "a", "weight": 0}]}, "greater_than", "weight"),
    ({"blend": [[1, "c"]], "packing": False}, "megatron_packing", "data.packing=false"),
    ({"synthetic": True, "blend": [[1, "c"]]}, "synthetic_with_path", "data.blend"),
])
def test_bad_data_sections_are_named(fields, rule, needle):
    with pytest.raises(ValidationError) as raised:
        DataSpec(**fields)
    errors = raised.value.errors()
    assert [e["type"] for e in errors] == [rule] and needle in str(raised.value), str(raised.value)


def test_a_resolved_section_loads_back():
    for data in (DataSpec(path="a.json", type="alpaca"), DataSpec(path="c.jsonl", type="sharegpt"),
                 DataSpec(mix=[{"path": "a.json", "type": "alpaca", "weight": 1},
                               {"path": "corpus", "format": "megatron", "weight": 2}], validation_fraction=0.1)):
        assert DataSpec(**data.model_dump()) == data


def test_mix_entries_inherit_the_shared_options():
    data = DataSpec(mix=[{"path": "a.json", "type": "alpaca", "weight": 1},
                         {"path": "corpus", "format": "megatron", "weight": 2}], tokenizer="tok",
                    validation_fraction=0.1, packing=True)
    (label_a, a), (label_b, b) = data_sources(data)
    assert (label_a, a.path, a.type, a.tokenizer, a.validation_fraction) == ("data.mix[0]", "a.json", "alpaca", "tok",
                                                                             0.1)
    assert b.is_megatron and not a.is_megatron and b.mix is None
