"""`data_check.json`: the record files a head checked, so that the ranks verify them instead of re-checking them.

`dsmt check`'s data checks format every record of every source (toolkit/check/data_checks.py): minutes on a large
jsonl. Run on every rank before rendezvous, the ranks' skew counts against the rendezvous timeout. So where the
head has checked the data (`dsmt generate`'s run directory, `dsmt train`'s launcher) it writes this digest: for
every record file it checked (data.path, each data.mix entry, data.validation_path) its path, size, mtime_ns and
xxh3_128 digest, with a digest of the spec's data section, the dsmt version and the record checks' version. A rank
whose spec has the same data section, under the same dsmt, compares each file's size and mtime, and hashes only
the files whose mtime moved (~0.3 s per GB from the page cache, toolkit/data/files.py), instead of formatting every
record:

  * the digest does not apply (another data section, dsmt version or check version; unreadable): every record is
    checked on the rank, as without a digest;
  * it applies and a file differs (size; content, where the mtime moved; a file missing or added to a folder):
    `data_changed_since_check`, naming each file, what changed and the fix. The head checked other data than this
    rank would train on. A different mtime alone is no change: a node's copy made with cp or scp has a new mtime and
    the same records. An edit that keeps both size and mtime goes unseen (as it would by make or rsync).

Megatron corpora are not listed: their checks read the .idx and the .bin's size only (toolkit/data/corpus_check.py),
cheap on every rank. Nor is data on no local path (a hub name): no digest is written then, and every rank checks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from toolkit import __version__
from toolkit.data.files import digest_file
from toolkit.errors import RuleError
from toolkit.spec.checked import CheckedJob
from toolkit.spec.data_schema import DataSpec, data_sources

DIGEST_FILE = "data_check.json"
FORMAT = 1
# The version of what the record checks refuse (toolkit/check/data_checks.py record_problems,
# validation_record_problems; toolkit/data/formats.py check_records): bump it when they change, so that a digest
# written by a dsmt whose checks passed other records no longer stands in for them.
RECORD_CHECKS_VERSION = 1
RULE = "data_changed_since_check"
RECORDS_NOT_FORMATTED = "records_not_formatted"  # the info rule of a report whose records were not formatted


class DataChangedError(RuleError):
    """A record file differs from the one the head checked (rule `data_changed_since_check`)."""

    def __init__(self, detail: str, *, digest_path: Path):
        super().__init__(detail, rule=RULE, fix=(
            "check the data as it is now and write the digest again: `dsmt generate SPEC --out RUN_DIR --overwrite` "
            "or `dsmt train` (its launcher checks before starting the ranks); or `dsmt check SPEC` and delete "
            f"{digest_path} so that every rank checks the records itself. If only this node's copy differs, copy "
            "the data again from the head"))


def digest_directory(*, run_dir: Path | None, output_dir: str | Path) -> Path:
    """Where a job's digest is written and looked for: its run directory, else its output directory (`dsmt train
    SPEC` without --run-dir)."""
    return Path(run_dir) if run_dir is not None else Path(output_dir).expanduser()


def record_files(data: DataSpec) -> list[tuple[str, Path]] | None:
    """(label, file) of every file whose records `dsmt check` formats, in a fixed order; None when a source is not
    on a local path (a dataset name in the hub cache): the digest cannot cover it. A folder: every file under it
    but its `.cache` (toolkit/data/sources.py reads the same ones)."""
    if data.synthetic:
        return []
    sources = [(label, source.path) for label, source in data_sources(data)
               if not source.is_megatron and source.path is not None]
    if data.validation_path is not None and not data.is_megatron:
        sources.append(("data.validation_path", data.validation_path))
    files = []
    for label, path in sources:
        path = Path(path).expanduser().absolute()
        if path.is_file():
            files.append((label, path))
        elif path.is_dir():
            files += [(label, f) for f in sorted(path.rglob("*")) if f.is_file() and ".cache" not in f.parts]
        else:
            return None
    return files


def data_section_digest(data: DataSpec) -> str:
    """The xxh3_128 of the data section as JSON (keys sorted): a rank's spec reads the same records only if equal."""
    import xxhash

    return xxhash.xxh3_128(json.dumps(data.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def digest_of(data: DataSpec) -> dict | None:
    """The digest of `data`'s record files (module docstring); None when there are none, or one is not local."""
    files = record_files(data)
    if not files:
        return None
    entries = []
    for label, path in files:
        stat = path.stat()
        entries.append({"source": label, "path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                        "xxh3_128": digest_file(path)})
    return {"format": FORMAT, "dsmt_version": __version__, "record_checks": RECORD_CHECKS_VERSION,
            "data_section_xxh3_128": data_section_digest(data), "checked_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "files": entries}


def write_job_digest(*, job: CheckedJob, directory: Path) -> Path | None:
    """`write_digest` of a checked job whose checks formatted its records: a transformer's (an HF model that is not
    one, job.model None, has its data checked cheaply on every rank: toolkit/check/plain_checks.py), and not a job
    whose report says they were skipped. Otherwise any digest in `directory` is removed."""
    if job.model is None or RECORDS_NOT_FORMATTED in job.report.rules():
        (Path(directory) / DIGEST_FILE).unlink(missing_ok=True)
        return None
    return write_digest(data=job.spec.data, directory=directory)


def write_digest(*, data: DataSpec, directory: Path) -> Path | None:
    """Write `data`'s digest into `directory` (atomically), after its records passed `dsmt check`'s checks; a stale
    digest there is removed when there is nothing to digest. Returns the file written, or None."""
    path = Path(directory) / DIGEST_FILE
    digest = digest_of(data)
    if digest is None:
        path.unlink(missing_ok=True)
        return None
    temporary = path.with_name(f".{DIGEST_FILE}.{os.getpid()}")
    temporary.write_text(json.dumps(digest, indent=2) + "\n")
    os.replace(temporary, path)
    return path


def verify_digest(*, data: DataSpec, directory: Path) -> str | None:
    """What a rank says when `directory`'s digest stands in for the record checks of `data` (its files verified);
    None when there is no digest for this data section, dsmt and check version (the records are checked as without
    one). Raises DataChangedError naming every file that differs."""
    path = Path(directory) / DIGEST_FILE
    try:
        digest = json.loads(path.read_text())
        applies = (digest.get("format") == FORMAT and digest.get("dsmt_version") == __version__
                   and digest.get("record_checks") == RECORD_CHECKS_VERSION
                   and digest.get("data_section_xxh3_128") == data_section_digest(data))
        recorded = {entry["path"]: entry for entry in digest["files"]} if applies else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: the full check is always right
    if recorded is None:
        return None
    started = time.perf_counter()
    files = record_files(data) or []
    changes = _changes(recorded=recorded, files=files, checked_at=digest.get("checked_at", "?"))
    if changes:
        raise DataChangedError(f"the data differs from what was checked ({path}, written {digest.get('checked_at')})"
                               ":\n  " + "\n  ".join(changes), digest_path=path)
    size = sum(entry["size"] for entry in recorded.values())
    return (f"{len(recorded)} record file(s), {size / 1e6:,.1f} MB, checked on {digest.get('checked_at')} and "
            f"verified against {path} ({time.perf_counter() - started:.1f} s)")


def _changes(*, recorded: dict, files: list[tuple[str, Path]], checked_at: str) -> list[str]:
    """One line per file that differs from its entry: missing, added, another size, or (where its mtime moved)
    another content."""
    present = {str(path): label for label, path in files}
    changes = [f"{entry['source']} {name}: missing (it was checked)" for name, entry in recorded.items()
               if name not in present]
    changes += [f"{label} {name}: added since the check" for name, label in present.items() if name not in recorded]
    for name, entry in recorded.items():
        if name not in present:
            continue
        stat = Path(name).stat()
        modified = ("" if stat.st_mtime_ns == entry["mtime_ns"] else
                    f", modified {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stat.st_mtime_ns / 1e9))}")
        if stat.st_size != entry["size"]:
            changes.append(f"{entry['source']} {name}: {stat.st_size} bytes, {entry['size']} when checked "
                           f"({checked_at}){modified}")
        elif modified and digest_file(Path(name)) != entry["xxh3_128"]:
            # Hashed only when the mtime moved (a copy to a node's disk, an edit): same size and mtime is the file
            # the head checked, and hashing a large corpus on every rank before rendezvous would bring back the
            # minutes (and the skew between ranks) the digest saves.
            changes.append(f"{entry['source']} {name}: same size, other content (xxh3_128 differs from the "
                           f"check's, {checked_at}){modified}")
    return changes
