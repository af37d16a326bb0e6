"""`dsmt train --dry-run` on the data: every source read as training reads it (records, Megatron corpora with the
model's tokenizer, a mix's entries), the validation side, and the tokenizer against the model's vocabulary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from toolkit.errors import DsmtError, Problem

# Records the dry run tokenises per source to apply the ranks' record-length rule: all of a small file, the start
# of a large one (about a second of a fast tokenizer's time; the ranks tokenise everything once, into the cache).
DRY_RUN_RECORDS = 10_000


def data_problems(*, spec, model_refused: bool = False) -> list[Problem]:
    """The data readable and the tokenizer present (and no larger than the model's vocabulary), and the records
    tokenised as the ranks tokenise them; for a model whose head is not a causal LM (masked LM, classification,
    images) the examples built as training builds them. `model_refused`: dsmt check found no model at model.path,
    so nothing (its tokenizer included) is read from it."""
    from toolkit.spec.data_schema import data_sources

    data = spec.data
    found = []
    text_data = not data.synthetic and (data.path is not None or data.blend is not None or data.mix is not None)
    task, head_config = _head_task(spec) if text_data else (None, None)
    if task not in (None, "causal_lm"):
        return task_data_problems(spec=spec, task=task, model_config=head_config) + validation_problems(
            spec=spec, num_records=None, task=task, model_config=head_config)
    no_tokenizer = model_refused and data.tokenizer is None  # it would be model.path's, which is no model
    tokenizer = None if no_tokenizer else _tokenizer_or_none(spec=spec)
    if text_data:
        for label, source in data_sources(data):
            if source.is_megatron:
                found += [] if tokenizer is None else corpus_problems(spec=spec, label=label, data=source)
            else:
                found += source_problems(spec=spec, label=label, data=source, task=task, tokenizer=tokenizer)
    elif data.synthetic:
        found.append(Problem("info", "data", "data.synthetic=true: synthetic tokens, no tokenizer needed"))
    if (text_data or data.tokenizer is not None) and not no_tokenizer:
        found += tokenizer_problems(spec=spec)
    return found


def _tokenizer_or_none(*, spec):
    """The tokenizer the ranks load (data.tokenizer, else model.path's); None where tokenizer_problems says why
    (or, for a built-in shape or an inline config, where the ranks write one with the random init)."""
    from toolkit.data import load_tokenizer

    if spec.data.tokenizer is None and spec.model.path is None:
        return None
    try:
        return load_tokenizer(data=spec.data, model_path=spec.model.path)
    except DsmtError:
        return None


def source_problems(*, spec, label: str, data, task, tokenizer=None) -> list[Problem]:
    from toolkit.data import load_records
    from toolkit.check.data_checks import source_here, unreadable_problem

    if not source_here(data):
        return []  # dsmt check's data_path_missing
    try:
        records = load_records(data=data)
    except DsmtError as err:
        return [unreadable_problem(label=label, err=err)]  # the same as dsmt check's (one line in the report)
    found = [Problem("info", "data", f"{label}.path={data.path}: {len(records)} records, fields "
                     f"{', '.join(records.column_names)}")]
    if tokenizer is not None:
        found += record_length_problems(spec=spec, label=label, data=data, records=records, tokenizer=tokenizer)
    if label == "data":  # a mix's validation: toolkit/data/training.py
        found += validation_problems(spec=spec, num_records=len(records), task=task)
    return found


def record_length_problems(*, spec, label: str, data, records, tokenizer) -> list[Problem]:
    """The records tokenised and fitted to training.seq_length by the ranks' own code (toolkit/data/tokenize.py,
    packing.py; preference pairs: preference_rows.py): when none keeps a loss-bearing token (or every pair's sides
    are the same), the ranks' error, here before any rank starts.
    A source larger than DRY_RUN_RECORDS is judged on its first records: a warning, as the rest may train."""
    import logging

    from toolkit.data import tokenize_examples
    from toolkit.data.formats import RecordError
    from toolkit.data.packing import NoLossTokensError
    from toolkit.data.preference_rows import PreferenceError
    from toolkit.data.sources import quieted_logger

    seq_length = spec.training.seq_length
    sample = records if len(records) <= DRY_RUN_RECORDS else records.select(range(DRY_RUN_RECORDS))
    part = "" if sample is records else f" (the first {len(sample)} of {len(records)} records)"
    try:
        with quieted_logger("toolkit.data.tokenize", level=logging.ERROR):  # its start-up lines: the info line below
            examples = tokenize_examples(records=sample, data=data, tokenizer=tokenizer, seq_length=seq_length)
    except (NoLossTokensError, PreferenceError) as err:  # no pair trains, or none differs: as the ranks would say
        return [Problem("error" if sample is records else "warning", err.rule,
                        f"{label}.path={data.path}{part}: {err.detail} (training.seq_length={seq_length})", err.fix)]
    except RecordError:
        return []  # dsmt check's record checks name each bad record with its line
    except DsmtError as err:
        return [Problem("error", getattr(err, "rule", "data_tokenize"), f"{label}.path={data.path}: {err}", "")]
    template = {False: "; the tokenizer has no chat_template: chats rendered as '<role>: <content>' lines"}
    return [Problem("info", "data_rows", f"{label}.path={data.path}{part} at training.seq_length={seq_length}: "
                    f"{examples.describe()}{template.get(examples.used_chat_template, '')}")]


def corpus_problems(*, spec, label: str, data) -> list[Problem]:
    """The corpora read by megatron-core's IndexedDataset and fitted to the model's tokenizer and vocabulary."""
    from toolkit.data import load_tokenizer
    from toolkit.data.corpus_check import CorpusDamaged
    from toolkit.data.indexed import corpus_problems as read_and_fit
    from toolkit.check.data_checks import damaged_problem
    from toolkit.spec.load import model_shape

    fix = ("prepare the corpus with the model's tokenizer "
           "(`dsmt data prepare INPUT --tokenizer MODEL_DIR --output PREFIX`)")
    try:
        tokenizer = load_tokenizer(data=data, model_path=spec.model.path)
        corpora, problems = read_and_fit(data=data, tokenizer=tokenizer, vocab_size=model_shape(spec.model).vocab_size)
    except DsmtError as err:  # no tokenizer, no model shape
        return [Problem("error", "megatron_corpus", f"{label}: {err}", fix)]
    # a damaged corpus: the same line as dsmt check's (the report shows it once)
    return [damaged_problem(label=label, err=err) if isinstance(err, CorpusDamaged) else
            Problem("error", err.rule, f"{label}: {err}", fix) for err in problems] + [
        Problem("info", "data", f"{label}: Megatron corpus {corpus.prefix}: {corpus.num_documents} documents, "
                f"{corpus.num_tokens} tokens, ids up to {corpus.max_token_id}") for corpus in corpora]


def validation_problems(*, spec, num_records: int | None, task: str | None, model_config=None) -> list[Problem]:
    """The validation records as training reads them (toolkit/data/validation.py): the file and its fields, or
    the held-out share's record counts; for heads other than a causal LM the task's validation examples, built
    as training builds them (toolkit/data/tasks.py)."""
    from toolkit.data import validation

    data = spec.data
    if not validation.has_validation(data) or data.synthetic:
        return []  # synthetic: `dsmt check` reports validation_synthetic
    if data.validation_path is not None and not Path(data.validation_path).expanduser().exists():
        return []  # `dsmt check` reports validation_path_missing
    if task not in (None, "causal_lm"):
        return task_validation_problems(spec=spec, task=task, model_config=model_config)
    try:
        if data.validation_path is not None:
            records = validation.load_validation_file(data=data)
            text = f"data.validation_path={data.validation_path}: {len(records)} validation records"
        elif num_records is None:
            return []
        else:
            split = validation.split_records(num_records=num_records, fraction=data.validation_fraction,
                                             seed=spec.training.seed)
            text = split.describe(fraction=data.validation_fraction, seed=spec.training.seed)
    except DsmtError as err:
        from toolkit.check.data_checks import validation_load_problem

        return [validation_load_problem(err)]  # the same line as dsmt check's, for the validation file
    return [Problem("info", "validation", text)]


def _head_task(spec) -> tuple[str | None, object]:
    """(training task of the checkpoint's head (toolkit/data/tasks.py), its HF config); (None, None) without a
    readable config.json or for a head the model checks report."""
    from transformers import AutoConfig

    from toolkit.data.tasks import task_of

    config_path = Path(spec.model.path or "") / "config.json"
    if spec.model.path is None or not config_path.is_file():
        return None, None
    try:
        config = AutoConfig.from_pretrained(spec.model.path, trust_remote_code=False)
        return task_of(config), config
    except (DsmtError, ValueError, OSError):
        return None, None


def task_data_problems(*, spec, task: str, model_config) -> list[Problem]:
    """Build the task's examples as a rank does (labels validated, images listed, tokenizer loaded)."""
    from toolkit.data.tasks import task_examples

    try:
        examples = task_examples(data=spec.data, model_config=model_config,
                                 tokenizer_path=spec.data.tokenizer or spec.model.path,
                                 seq_length=spec.training.seq_length, seed=spec.training.seed)
    except DsmtError as err:
        return [Problem("error", getattr(err, "rule", "data_unreadable"), str(err), "fix data.path or its records")]
    return [Problem("info", "data", f"data.path={spec.data.path}: {len(examples)} examples for {task}")]


def task_validation_problems(*, spec, task: str, model_config) -> list[Problem]:
    """The task's validation examples built as a rank builds them (`task_examples(part="validation")`)."""
    from toolkit.data.tasks import task_examples
    from toolkit.data.validation import VALIDATION, describe_source

    try:
        examples = task_examples(data=spec.data, model_config=model_config,
                                 tokenizer_path=spec.data.tokenizer or spec.model.path,
                                 seq_length=spec.training.seq_length, seed=spec.training.seed, part=VALIDATION)
    except DsmtError as err:
        return [Problem("error", getattr(err, "rule", "validation_data"), f"{describe_source(spec.data)}: {err}",
                        "fix data.validation_path / data.validation_fraction or the validation records")]
    return [Problem("info", "validation", f"{describe_source(spec.data)}: {len(examples)} validation examples for "
                    f"{task}")]


def tokenizer_problems(*, spec) -> list[Problem]:
    from toolkit.data import load_tokenizer
    from toolkit.spec.load import model_shape
    from toolkit.train.job.pretrain import tokenizer_fit_problems

    data, model = spec.data, spec.model
    if data.tokenizer is None and model.path is None:
        if model.builtin is not None:
            return []  # dsmt check's builtin_needs_tokenizer
        vocab_size = model.config.get("vocab_size", 0)
        if vocab_size >= 64:  # toolkit/models/tiny.py save_random_init writes its character tokenizer then
            return [Problem("info", "tokenizer", "tokenizer: dsmt's tiny character tokenizer, written with the "
                            "random init of model.config")]
        return [Problem("error", "tokenizer", f"model.config has vocab_size={vocab_size}, too small for dsmt's tiny "
                        "tokenizer, and data.tokenizer is unset", "set data.tokenizer")]
    try:
        tokenizer = load_tokenizer(data=data, model_path=model.path)
    except DsmtError as err:
        return [Problem("error", "tokenizer", str(err), "")]
    try:
        vocab_size = model_shape(model).vocab_size
    except DsmtError:
        return []  # no transformer shape (a plain model): nothing to compare with
    where = f"model.builtin={model.builtin}" if model.builtin else "the model"
    fit = tokenizer_fit_problems(tokenizer=tokenizer, vocab_size=vocab_size, where=where,
                                 tokenizer_ref=data.tokenizer or model.path)
    if model.builtin is None:  # a checkpoint's own tokenizer may list ids its data never produces; training checks ids
        fit = [dataclasses.replace(p, severity="warning") for p in fit]
    ref = data.tokenizer or model.path
    return fit or [Problem("info", "tokenizer", f"tokenizer {ref}: {len(tokenizer)} tokens, fits vocab_size={vocab_size}")]
