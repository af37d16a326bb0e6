"""The rows a training job draws from, for one data part ("train" or "validation"): every source kind behind
one call.

  * `data.synthetic`: generated on each rank (a pure function of the seed);
  * records (`data.path`: file, folder, cached name): formatted, tokenised and packed once per job on rank 0 into
    the on-disk cache, memory-mapped on every rank (toolkit/data/cache.py, toolkit/data/pipeline.py);
  * Megatron corpora (`format: megatron`, `data.blend`): megatron-core's GPTDataset / BlendedDataset over the
    memory-mapped `.bin` (toolkit/data/indexed.py);
  * `data.mix`: each entry's rows by the rules above, drawn by weight (toolkit/data/mix.py).
Collective over the default process group (every rank calls it with the same arguments)."""

from __future__ import annotations

from pathlib import Path

from toolkit.data import validation
from toolkit.data.cache import cache_root_for, shared_examples
from toolkit.data.pipeline import build_examples
from toolkit.data.preference_rows import PreferenceError
from toolkit.spec.data_schema import DataSpec, mix_entry_data


def job_rows(*, data: DataSpec, model_path: str | None, seq_length: int, vocab_size: int, seed: int,
             output_dir: str | Path, part: str = validation.TRAIN, num_samples: int | None = None):
    """The rows of `part`: an `Examples` or a row source with its interface (toolkit/data/examples.py); for
    `data.type: preference` a `PreferenceExamples` (toolkit/data/preference_rows.py).
    `num_samples`: the samples a Megatron corpus must provide for training (train_steps x global batch)."""
    refuse_preference_sources(data)
    if data.synthetic:
        if part == validation.VALIDATION:
            raise validation.ValidationDataError("data.synthetic=true has no validation records; unset "
                                                 "data.validation_path and data.validation_fraction, or train on "
                                                 "data.path")
        return build_examples(data=data, model_path=model_path, seq_length=seq_length, vocab_size=vocab_size,
                              seed=seed)
    common = dict(model_path=model_path, seq_length=seq_length, vocab_size=vocab_size, seed=seed,
                  output_dir=output_dir)
    if data.mix is not None:
        return _mixed_rows(data=data, part=part, num_samples=num_samples, **common)
    if data.is_megatron:
        return _megatron_rows(data=data, part=part, num_samples=num_samples, **common)
    return _cached_rows(data=data, part=part, status_name=part, **common)


def refuse_preference_sources(data: DataSpec) -> None:
    """Preference pairs come only from the records of one source: a mix draws rows (not pairs) by weight, and
    Megatron corpora and synthetic tokens hold documents, not prompt/chosen/rejected."""
    in_mix = [f"data.mix[{i}]" for i, entry in enumerate(data.mix or []) if entry.type == "preference"]
    where = ("data.mix" if data.mix is not None else "data.blend / data.format=megatron" if data.is_megatron
             else "data.synthetic=true" if data.synthetic else None)
    if where is None or (data.type != "preference" and not in_mix):
        return
    said = f"data.type=preference in {', '.join(in_mix)}" if in_mix else "data.type=preference"
    raise PreferenceError(rule="preference_source", message=f"{said} with {where}: preference pairs are read from "
                          f"the records of one data.path", fix=f"unset {where.split('=')[0]} and set data.path to "
                          f"a file or folder of preference records")


def _cached_rows(*, data: DataSpec, model_path, seq_length: int, vocab_size: int, seed: int, output_dir, part: str,
                 status_name: str):
    """Rank 0 formats, tokenises and packs (or reuses the cache); every rank memory-maps the result."""
    status = Path(output_dir) / (".data-cache.status.json" if status_name == validation.TRAIN
                                 else f".data-cache-{status_name}.status.json")
    return shared_examples(data=data, model_path=model_path, seq_length=seq_length, vocab_size=vocab_size, seed=seed,
                           cache_root=cache_root_for(data=data, output_dir=output_dir), status_file=status, part=part)


def _mixed_rows(*, data: DataSpec, part: str, num_samples: int | None, **common):
    from toolkit.data.mix import MixedRows

    if part == validation.VALIDATION and data.validation_path is not None:  # one validation file for the mix
        alone = data.model_copy(update={"mix": None, "path": data.validation_path, "validation_path": None})
        return _cached_rows(data=alone, part=validation.TRAIN, status_name="validation", **common)
    parts, weights = [], []
    for index, entry in enumerate(data.mix):
        spec = mix_entry_data(data=data, entry=entry)
        if spec.is_megatron:
            share = None if num_samples is None else max(1, round(num_samples * entry.weight / _total(data)))
            parts.append(_megatron_rows(data=spec, part=part, num_samples=share, **common))
        else:
            parts.append(_cached_rows(data=spec, part=part, status_name=f"{part}-mix{index}", **common))
        weights.append(entry.weight)
    # validation: every entry's held-out rows once, not re-drawn by weight
    return MixedRows(parts=parts, weights=weights if part == validation.TRAIN else None, seed=common["seed"],
                     names=[entry.path for entry in data.mix])


def _megatron_rows(*, data: DataSpec, model_path, seq_length: int, vocab_size: int, seed: int, output_dir, part: str,
                   num_samples: int | None):
    from toolkit.data.indexed import megatron_rows

    return megatron_rows(data=data, model_path=model_path, part=part, num_samples=num_samples, seq_length=seq_length,
                         vocab_size=vocab_size, seed=seed,
                         cache_root=cache_root_for(data=data, output_dir=output_dir) / "megatron")


def _total(data: DataSpec) -> float:
    return sum(entry.weight for entry in data.mix)
