"""`dsmt check` on the `data` section: a source to train on, and what of it can be read on this machine.

* records on this machine (a file, a folder, a dataset name in the local Hugging Face cache with
  `HF_HUB_OFFLINE=1`): every record is formatted by its `data.type` (toolkit/data/formats.py), and each bad one
  is an error naming the record, its line (jsonl) and the fix; nothing is tokenised here;
* Megatron corpora (`format: megatron`, `data.blend`): `PREFIX.bin` / `PREFIX.idx` present and consistent
  (toolkit/data/corpus_check.py: the .idx against itself, the .bin's size, the sidecar's record; their digests
  with `--deep`), and the largest token id `dsmt data prepare` recorded below the model's vocabulary (the
  tokenizer itself: `dsmt train --dry-run` and every rank before reading);
* sources that are not on this machine are a warning: the spec may be meant for the cluster.
Records are formatted once per launch: a rank whose run (or output) directory holds the head's data_check.json for
this data section verifies the files against it instead (toolkit/data/check_digest.py, `skip_records`).
"""

from __future__ import annotations

from pathlib import Path

from toolkit.models.shapes import ModelShape
from toolkit.spec.data_schema import DATA_SOURCE_FIX, DataSpec, data_sources, megatron_corpora
from toolkit.errors import Problem

RECORD_ERRORS_SHOWN = 5  # bad records listed per source; the count of all is in the message
# A spec names files of the machine it is checked on: the launcher, every rank and the dry run read them there.
ELSEWHERE = ("relative paths are taken against the spec file's folder; a spec for another machine is checked "
             "there (`dsmt check` reads what the ranks will read)")


def check_data(*, spec, shape: ModelShape | None, skip_records: str | None = None) -> list[Problem]:
    """The data section's sources. `skip_records`: why their records are not formatted here (a rank whose
    data_check.json verified the files the head checked, toolkit/data/check_digest.py; `toolkit.api.initialize`),
    said in one info line; Megatron corpora are checked all the same (cheap)."""
    data = spec.data
    if data.synthetic:
        return [Problem("info", "synthetic_data", "data.synthetic=true: training uses synthetic tokens")]
    if data.path is None and data.blend is None and data.mix is None:  # made-up tokens must be asked for
        return [Problem("error", "data_source", "data.path is unset and data.synthetic=false: there is no data to "
                        "train on", DATA_SOURCE_FIX)]
    problems, skipped = [], False
    for label, source in data_sources(data):
        if source.is_megatron:
            problems += corpus_problems(label=label, data=source, vocab_size=shape.vocab_size if shape else None)
        elif skip_records is None:
            problems += record_problems(label=label, data=source)
        else:
            skipped = True
    return problems + ([records_skipped_problem(skip_records)] if skipped else [])


def records_skipped_problem(reason: str) -> Problem:
    """The info line that stands for the record checks when they are not run here."""
    from toolkit.data.check_digest import RECORDS_NOT_FORMATTED  # a report with it writes no data_check.json

    return Problem("info", RECORDS_NOT_FORMATTED, f"data records not formatted here: {reason}")


def corpus_problems(*, label: str, data: DataSpec, vocab_size: int | None) -> list[Problem]:
    from toolkit.data.corpus_check import CorpusDamaged, check_corpus
    from toolkit.data.prepare import missing_corpus_files, read_sidecar
    from toolkit.errors import DsmtError

    problems = []
    for _, prefix in megatron_corpora(data):
        missing = missing_corpus_files(prefix)
        if missing:
            problems.append(Problem("error", "megatron_corpus_missing", f"{label}: Megatron corpus {prefix} lacks "
                                    f"{', '.join(missing)} on this machine", "`dsmt data prepare INPUT --tokenizer DIR "
                                    f"--output PREFIX`, or fix the prefix; {ELSEWHERE}"))
            continue
        try:
            facts = read_sidecar(prefix)
        except DsmtError as err:
            problems.append(Problem("error", "megatron_sidecar", f"{label}: {err}", ""))  # the fix: in the text
            continue
        try:
            index = check_corpus(prefix, sidecar=facts)
        except CorpusDamaged as err:
            problems.append(damaged_problem(label=label, err=err))
            continue
        if facts is None:
            problems.append(Problem("info", "megatron_corpus", f"{label}: Megatron corpus {prefix}: "
                                    f"{index.num_sequences} documents, {index.num_tokens} tokens (not prepared by "
                                    "dsmt: its token ids are scanned against the vocabulary when training starts)"))
        elif vocab_size is not None and facts["max_token_id"] >= vocab_size:
            problems.append(Problem("error", "token_ids_vocab", f"{label}: Megatron corpus {prefix} holds token id "
                                    f"{facts['max_token_id']} (prepared with tokenizer {facts.get('tokenizer')}), but "
                                    f"the model's vocab_size is {vocab_size}",
                                    "prepare the corpus with the model's own tokenizer"))
        else:
            problems.append(Problem("info", "megatron_corpus", f"{label}: Megatron corpus {prefix}: "
                                    f"{facts['num_documents']} documents, {facts['num_tokens']} tokens"))
    return problems


def damaged_problem(*, label: str, err) -> Problem:
    """A CorpusDamaged as `dsmt check` and the dry run both report it (one line in `dsmt check --deep`)."""
    return Problem("error", err.rule, f"{label}: {err.detail}", err.fix)


def corpus_digest_problems(*, data: DataSpec) -> list[Problem]:
    """`dsmt check --deep`: every Megatron corpus's files hashed against the digests `dsmt data prepare` recorded
    (corpora missing or refused by the cheap checks are reported by those)."""
    import time

    from toolkit.data.corpus_check import CorpusDamaged, check_corpus, check_digests
    from toolkit.data.prepare import missing_corpus_files, read_sidecar
    from toolkit.errors import DsmtError

    problems = []
    for label, source in data_sources(data):
        for _, prefix in megatron_corpora(source) if source.is_megatron else []:
            started = time.perf_counter()
            try:
                if missing_corpus_files(prefix):
                    continue
                sidecar = read_sidecar(prefix)
                check_corpus(prefix, sidecar=sidecar)
            except DsmtError:
                continue  # CorpusDamaged, an unreadable sidecar: the cheap checks' line says it
            try:
                hashed = check_digests(prefix, sidecar=sidecar)
            except CorpusDamaged as err:
                problems.append(damaged_problem(label=label, err=err))
                continue
            seconds = time.perf_counter() - started
            said = ("no digests recorded (no dsmt sidecar, or one written before dsmt recorded them): its .idx "
                    "checked only" if hashed is None else
                    f"{hashed / 1e6:,.1f} MB match their xxh3_128 digests ({seconds:.1f} s)")
            problems.append(Problem("info", "corpus_digests", f"{label}: Megatron corpus {prefix}: {said}"))
    return problems


def record_problems(*, label: str, data: DataSpec) -> list[Problem]:
    """The records of `data` formatted by their type when they are on this machine (see the module docstring)."""
    if not source_here(data):
        return [Problem("error", "data_path_missing", f"{label}.path={data.path} does not exist on this machine",
                        f"fix the path; {ELSEWHERE}")]
    from toolkit.data.sources import load_records
    from toolkit.errors import DsmtError

    _quiet_datasets()
    try:
        records = load_records(data=data)
    except DsmtError as err:
        return [unreadable_problem(label=label, err=err)]
    path = Path(data.path).expanduser()  # a file: its errors get line numbers; a folder or cached name: none
    return formatted_record_problems(label=label, records=records, data=data, path=data.path,
                                     source=str(path) if path.is_file() else None)


def formatted_record_problems(*, label: str, records, data: DataSpec, path: str, source: str | None) -> list[Problem]:
    """Every record of `records` (read from `path`) formatted by data.type: one info line, or an error per bad
    record (the first RECORD_ERRORS_SHOWN) with its line where `source` is a JSON-lines file."""
    from toolkit.data.formats import check_records
    from toolkit.data.records import record_fields, record_type

    checked = check_records(records, record_type=record_type(data), fields=record_fields(data), source=source,
                            limit=RECORD_ERRORS_SHOWN)
    readable = checked.num_records - checked.num_bad
    identical = [identical_problem(label=label, path=path, num_pairs=readable)] if (
        readable and checked.num_identical == readable) else []
    if not checked.errors:
        return identical or [Problem("info", "records", f"{label}: {checked.num_records} {record_type(data)} records "
                                     f"in {path}, all readable")]
    more = (f" ({checked.num_bad} bad records in all, the first {len(checked.errors)} shown)"
            if checked.num_bad > len(checked.errors) else "")
    return [Problem("error", err.rule, f"{label}: {path}: {err}{more if i == 0 else ''}", "")  # fix: in the text
            for i, err in enumerate(checked.errors)] + identical


def identical_problem(*, label: str, path: str, num_pairs: int) -> Problem:
    """Every readable preference record has chosen == rejected: the rule training raises
    (toolkit/data/preference_rows.py)."""
    from toolkit.data.preference_rows import identical_error

    err = identical_error(num_pairs=num_pairs, where=f"of {path}")
    return Problem("error", err.rule, f"{label}: {err.detail}", err.fix)


def validation_record_problems(*, data: DataSpec) -> list[Problem]:
    """The records of data.validation_path read as training reads them (toolkit/data/validation.py: the fields of
    data.path's kind), then each formatted by its type, with its line."""
    from toolkit.data.validation import load_validation_file
    from toolkit.errors import DsmtError

    _quiet_datasets()
    try:
        records = load_validation_file(data=data)
    except DsmtError as err:
        return [validation_load_problem(err)]
    path = Path(data.validation_path).expanduser()
    return formatted_record_problems(label="data.validation_path", records=records, data=data,
                                     path=data.validation_path, source=str(path) if path.is_file() else None)


def validation_load_problem(err) -> Problem:
    """The validation file refused by its loader, as `dsmt check` and the dry run both report it."""
    rule = getattr(err, "rule", "validation_data")
    return Problem("error", rule, str(err).removeprefix(f"{rule}: "), "fix data.validation_path / "
                   "data.validation_fraction")


def source_here(data: DataSpec) -> bool:
    """data.path is on this machine: a file or folder, or a dataset name in the local HF cache while offline."""
    from toolkit.data.sources import cached_snapshot, hub_offline
    from toolkit.spec.data_paths import looks_like_hub_id

    return Path(data.path).expanduser().exists() or bool(
        hub_offline() and looks_like_hub_id(data.path) and cached_snapshot(data.path))


def unreadable_problem(*, label: str, err) -> Problem:
    """A source the loader refused, as `dsmt check` and the dry run both report it (the message names the fix:
    the fields present, the types accepted)."""
    return Problem("error", getattr(err, "rule", "data_unreadable"), f"{label}: {err}", "")


def megatron_rows_only_problems(*, data: DataSpec, trainer: str, record_types: bool) -> list[Problem]:
    """Sources only the megatron-core causal-LM path reads (Megatron corpora, mixes; with `record_types`, the
    record types other than text), refused for `trainer` (an encoder head's task, a model without an adapter)."""
    used = [name for name, present in (("data.format=megatron / data.blend", data.is_megatron),
                                       ("data.mix", data.mix is not None),
                                       (f"data.type={data.type}", record_types and data.type not in ("auto", "text")))
            if present]
    if not used:
        return []
    return [Problem("error", "data_needs_causal_lm", f"{', '.join(used)}: read only when a megatron-core causal LM "
                    f"trains, but this model trains {trainer}",
                    "give data.path with text records (and data.label_field for classification)")]


def _quiet_datasets() -> None:
    """No "Generating train split" bars in a check's report (`--verbose` / DSMT_SHOW_WARNINGS keep them)."""
    import datasets

    from toolkit.launch.rank_output import warnings_shown

    if not warnings_shown():
        datasets.disable_progress_bars()
