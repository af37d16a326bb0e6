"""The `data` section of a job spec: where the records come from and how they become tokens.

One source per spec, exactly one of:
  * `path`: a jsonl/json/csv/parquet/text file, a `save_to_disk` directory, a dataset repository folder as the hub
    CLI leaves it, a dataset name in the local Hugging Face cache, or (`format: megatron`) the prefix of a
    Megatron indexed corpus (`PREFIX.bin` / `PREFIX.idx`, from `dsmt data prepare`);
  * `blend`: Megatron indexed corpora mixed by weight, `[[0.3, PREFIX_A], [0.7, PREFIX_B]]`;
  * `mix`: sources of any kind above mixed by weight, each with its own `type` and fields;
  * `synthetic: true`: generated tokens (benchmarks, smoke tests).
`type` says how a record becomes text to learn (toolkit/data/formats.py): `auto` keeps the field options' meaning
(`messages_field` set: chat; `prompt_field`: prompt/completion; else `text_field`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from toolkit.spec.sections import Section, _safe_path

# The fix of a spec with no data (rule data_source), as `dsmt check` and the trainer word it.
DATA_SOURCE_FIX = ("set data.path to a jsonl/json/csv/parquet/text file, a save_to_disk or dataset repository "
                   "folder, a Megatron corpus prefix with data.format: megatron, or data.blend / data.mix; or "
                   "data.synthetic: true for synthetic tokens (benchmarks, smoke tests)")
# The field options each record type reads (the others would be silently ignored, so they are refused).
TYPE_FIELDS = {"auto": {"text_field", "prompt_field", "completion_field", "messages_field"},
               "text": {"text_field"}, "completion": {"prompt_field", "completion_field"}, "alpaca": set(),
               "sharegpt": {"messages_field"}, "messages": {"messages_field"},
               "preference": set()}
# Rules raised below (toolkit/spec/schema.py SCHEMA_RULES lists them with the others).
DATA_RULES = frozenset({"messages_vs_prompt", "prompt_completion_pair", "synthetic_with_path", "validation_both",
                        "data_sources_exclusive", "type_fields", "megatron_type", "megatron_validation_path",
                        "blend_entry", "mix_empty", "megatron_packing"})


class RecordSource(Section):
    """Where records are and how they read: what a `data.mix` entry and the `data` section share."""

    path: str | None = None
    # auto: from the extension; megatron: `path` is the prefix of an indexed corpus (PREFIX.bin / PREFIX.idx)
    format: Literal["auto", "jsonl", "json", "csv", "parquet", "text", "arrow", "megatron"] = "auto"
    type: Literal["auto", "text", "completion", "alpaca", "sharegpt", "messages", "preference"] = "auto"
    config: str | None = None  # a dataset repository's configuration (its README `configs`), or a cached name's
    split: str = "train"
    text_field: str = "text"
    prompt_field: str | None = None  # with completion_field: loss on the completion only
    completion_field: str | None = None
    messages_field: str | None = None  # chat records [{"role", "content"}, ...]: loss on assistant turns only

    @field_validator("path")
    @classmethod
    def _source_path_ok(cls, value):
        return _safe_path(value, what="data path")

    @model_validator(mode="after")
    def _fields_fit_type(self):
        if (self.prompt_field is None) != (self.completion_field is None):
            raise PydanticCustomError(
                "prompt_completion_pair", "prompt_field and completion_field go together (got only one)", {})
        if self.messages_field is not None and self.prompt_field is not None:
            raise PydanticCustomError(
                "messages_vs_prompt",
                "messages_field={messages} (chat) and prompt_field/completion_field are exclusive; keep one record kind",
                {"messages": repr(self.messages_field)})
        # a field set to its default says nothing (a resolved spec writes every field out)
        given = {name for name in set().union(*TYPE_FIELDS.values())
                 if getattr(self, name) != type(self).model_fields[name].default}
        stray = sorted(given - TYPE_FIELDS[self.type])
        if stray:
            raise PydanticCustomError(
                "type_fields", "data.type={type} does not read {stray}; remove it, or set the type that reads it "
                "(text: text_field; completion: prompt_field/completion_field; sharegpt, messages: messages_field; "
                "alpaca reads instruction/input/output)", {"type": self.type, "stray": ", ".join(stray)})
        if self.format == "megatron" and self.type not in ("auto", "text"):
            raise PydanticCustomError(
                "megatron_type", "data.format=megatron is a corpus of token ids (documents, no fields), but "
                "data.type={type}; remove data.type, or point data.path at the {type} records",
                {"type": self.type})
        return self


class MixSource(RecordSource):
    """One entry of `data.mix`: a source, its share of the training samples and its record options."""

    path: str
    weight: float = Field(gt=0)  # relative: the weights of a mix need not sum to 1


class DataSpec(RecordSource):
    synthetic: bool = False  # generated token sequences instead of data.path (benchmarks, smoke tests)
    blend: list[tuple[float, str]] | None = None  # Megatron corpora by weight: [[0.3, PREFIX_A], [0.7, PREFIX_B]]
    mix: list[MixSource] | None = None  # sources of any kind by weight: [{path, weight, type, ...}, ...]
    cache_dir: str | None = None  # tokenised-examples and Megatron index cache; None: <training.output_dir>/data-cache
    label_field: str = "label"  # *ForSequenceClassification: class id, label2id name, or a number (num_labels=1)
    tokenizer: str | None = None  # None: the model's path
    shuffle: bool = True
    # Causal LM records: true packs whole records into each sequence, each attending only to itself with positions
    # restarting at 0 (per-document attention); false gives each record its own sequence, padded.
    packing: bool = True
    validation_path: str | None = None  # a file of the same kind and fields as data.path
    validation_fraction: float | None = Field(None, gt=0, lt=1)  # or: hold out this share of data.path's records

    @field_validator("tokenizer", "cache_dir", "validation_path")
    @classmethod
    def _path_ok(cls, value):
        return _safe_path(value, what="data path")

    @field_validator("blend")
    @classmethod
    def _blend_ok(cls, value):
        for weight, prefix in value or ():
            if not weight > 0 or not prefix or any(ch in prefix for ch in "\n\r\0"):
                raise PydanticCustomError(
                    "blend_entry", "data.blend entry [{weight}, {prefix}] needs a weight > 0 and a corpus prefix "
                    "(PREFIX of PREFIX.bin / PREFIX.idx)", {"weight": weight, "prefix": repr(prefix)})
        if value is not None and not value:
            raise PydanticCustomError("blend_entry", "data.blend is empty; give [[weight, PREFIX], ...]", {})
        return value

    @model_validator(mode="after")
    def _one_source(self):
        given = [f"{name}={value!r}" for name, value in (("data.path", self.path), ("data.blend", self.blend),
                                                         ("data.mix", self.mix)) if value is not None]
        if self.synthetic and given:
            raise PydanticCustomError(
                "synthetic_with_path", "data.synthetic=true and {given} are exclusive; set data.path for real "
                "data, or data.synthetic: true (no path) for synthetic tokens", {"given": " and ".join(given)})
        if len(given) > 1:
            raise PydanticCustomError(
                "data_sources_exclusive", "{given} are exclusive: a spec has one data source; put several sources "
                "in data.mix (any kind) or data.blend (Megatron corpora)", {"given": " and ".join(given)})
        if self.mix is not None and not self.mix:
            raise PydanticCustomError("mix_empty", "data.mix is empty; give [{path, weight, ...}, ...]", {})
        if self.validation_path is not None and self.validation_fraction is not None:
            raise PydanticCustomError(
                "validation_both", "data.validation_path={path} and data.validation_fraction={fraction} are "
                "exclusive; give a validation file or the share of data.path to hold out",
                {"path": repr(self.validation_path), "fraction": self.validation_fraction})
        if self.validation_path is not None and (self.format == "megatron" or self.blend is not None):
            raise PydanticCustomError(
                "megatron_validation_path", "data.validation_path={path} with a Megatron corpus: its validation "
                "samples come from the corpus itself; use data.validation_fraction (Megatron's train/valid split)",
                {"path": repr(self.validation_path)})
        if self.is_megatron and not self.packing:
            raise PydanticCustomError(
                "megatron_packing", "data.packing=false with a Megatron corpus: its samples are token runs cut "
                "across documents (per-document attention from the EOD positions), not one record per row; remove "
                "data.packing, or train on records", {})
        return self

    @property
    def is_megatron(self) -> bool:
        """Token ids from Megatron indexed corpora (`format: megatron` or `blend`), not records to tokenise."""
        return self.blend is not None or (self.format == "megatron" and self.path is not None)


def mix_entry_data(*, data: DataSpec, entry: MixSource) -> DataSpec:
    """A `data.mix` entry as a data section of its own: its source and record options, the mix's tokenizer,
    cache, packing and held-out share."""
    inherited = data.model_dump(include={"tokenizer", "cache_dir", "packing", "shuffle", "validation_fraction",
                                         "label_field"}, exclude_unset=True)
    return DataSpec(**inherited, **entry.model_dump(exclude={"weight"}, exclude_unset=True))


def megatron_corpora(data: DataSpec) -> list[tuple[float | None, str]]:
    """(weight, prefix) of each Megatron corpus of `data`: `data.blend`, or `data.path` alone (weight None)."""
    if data.blend is not None:
        return [(weight, prefix) for weight, prefix in data.blend]
    return [(None, data.path)]


def data_sources(data: DataSpec) -> list[tuple[str, DataSpec]]:
    """(label, data section) of every source of `data`: the mix's entries, or `data` itself."""
    if data.mix is None:
        return [("data", data)]
    return [(f"data.mix[{index}]", mix_entry_data(data=data, entry=entry)) for index, entry in enumerate(data.mix)]
