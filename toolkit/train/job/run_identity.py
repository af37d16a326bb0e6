"""One output directory, one run: the job that wrote an output directory's checkpoints is recorded there, and a
`dsmt train` whose spec would continue those checkpoints as another job is refused before any rank starts.

    <output_dir>/dsmt_run.json   {"format": 1, "settings": {dotted key: value}, "files": {dotted key: fingerprint},
                                  "changes": [{"time", "keys"}]}

Without it a second run with another data file, lr or seq_length resumed the first one's step and trained on, and
one with the same train_steps handed back the first run's export. Every spec setting is part of the identity
except the two lists below:
  * FREE: how the run is watched and stored (logging, checkpoint cadence, timeouts, cluster plumbing): never compared;
  * CHANGEABLE: what a user changes on purpose when continuing (train_steps and the schedule's floor, evaluation,
    the layout: a checkpoint reshards to another TP/PP/DP/ZeRO): accepted with `--continue-with-changes`.
Anything else (model, data, batch, seq_length, optimizer, precision, seed, LoRA) makes another run: use a new
output_dir. A new spec field is identity until listed here, so a new setting can never slip through.

Files named by the spec (model folder, data, tokenizer, init adapter) are compared by content, not by path string:
a moved dataset continues, a replaced one does not. Their fingerprint is the size and an xxh3_128 digest of the
whole file up to SAMPLE_WHOLE_BYTES, else of its head, tail and 16 evenly spaced blocks (a 100 GB corpus is not
re-read at every launch; an edited or replaced file changes its size or a sampled block with near certainty, an
in-place edit of equal size between samples is not caught). The identity binds only once the directory holds
something of the run (a complete checkpoint or an export): a first launch that failed early can be corrected
freely."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import xxhash

from toolkit.data.files import digest_file
from toolkit.errors import DsmtError, RuleError

IDENTITY_FILE = "dsmt_run.json"
FORMAT = 1
RULE = "another_run_in_output_dir"
RECORD_FIX = "restore it, or train into a new training.output_dir"
SAMPLE_WHOLE_BYTES = 4 * 2**20
SAMPLE_BLOCK_BYTES = 64 * 2**10
MAX_FOLDER_FILES = 2000  # a folder of more files (an image folder) is fingerprinted by its first ones

# A pattern names a setting or a whole section ("cluster.slurm": every key under it).
FREE = ("training.log_interval", "training.tensorboard", "training.wandb", "training.checkpoint_interval",
        "training.keep_checkpoints", "training.collective_timeout_s", "training.preemption_grace_s",
        "training.hang_timeout_s", "training.max_skipped_steps", "training.output_dir", "training.lora.export",
        "training.async_save", "training.export_hf_interval",
        "data.cache_dir",
        "communication", "cluster.gpu", "cluster.hosts", "cluster.master_addr", "cluster.master_port",
        "cluster.network_interface", "cluster.interconnect", "cluster.launcher", "cluster.job_name",
        "cluster.slurm")
# ... except these communication settings: they choose DeepSpeed's optimizer wrapper, hence its state's layout
NOT_FREE = ("communication.communication_data_type", "communication.grad_accum_dtype")
CHANGEABLE = ("training.train_steps", "training.min_lr", "training.eval_interval", "data.validation_path",
              "parallel", "training.micro_batch_size", "training.recompute", "training.attention", "training.fusions",
              "cluster.nodes", "cluster.gpus_per_node", "cluster.device")
# spec keys that name files or folders, compared by fingerprint ("*": any list index)
PATH_KEYS = ("model.path", "data.path", "data.validation_path", "data.tokenizer", "data.mix.*.path",
             "data.blend.*.1", "training.lora.init_adapter")


def _matches(key: str, patterns) -> bool:
    return any(key == p or key.startswith(f"{p}.") or _star(key, p) for p in patterns)


def _free(key: str) -> bool:
    return _matches(key, FREE) and not _matches(key, NOT_FREE)


def _star(key: str, pattern: str) -> bool:
    parts, wanted = key.split("."), pattern.split(".")
    return "*" in wanted and len(parts) == len(wanted) and all(w in ("*", k) for k, w in zip(parts, wanted))


def flatten(value, prefix: str = "") -> dict[str, object]:
    """{dotted key: leaf} of a JSON-like value (list items by index)."""
    if isinstance(value, dict) and value:
        items = value.items()
    elif isinstance(value, (list, tuple)) and value:
        items = ((str(i), item) for i, item in enumerate(value))
    else:
        return {prefix: value}
    flat = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def fingerprint_file(path: Path) -> str:
    """size:xxh3_128 of the whole file, or of its head, tail and 16 spaced blocks past SAMPLE_WHOLE_BYTES."""
    stat = Path(path).stat()
    return _fingerprint(str(Path(path).resolve()), size=stat.st_size, mtime_ns=stat.st_mtime_ns, inode=stat.st_ino)


@functools.lru_cache(maxsize=4096)
def _fingerprint(path: str, *, size: int, mtime_ns: int, inode: int) -> str:
    """Read once per process while the file's stat stays the same: `dsmt train` compares before its pre-launch
    pass (to refuse in a second, not after it), in it (what `--dry-run` reports) and records under the run lock."""
    if size <= SAMPLE_WHOLE_BYTES:
        return f"{size}:{digest_file(Path(path))}"
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as reader:
        last = size - SAMPLE_BLOCK_BYTES
        for offset in [0, *(last * i // 17 for i in range(1, 17)), last]:
            reader.seek(offset)
            hasher.update(reader.read(SAMPLE_BLOCK_BYTES))
    return f"{size}:{hasher.hexdigest()}"


def fingerprint_path(path: Path) -> str | None:
    """A file's fingerprint; a folder's over its regular files (relative names included); None when the path is
    not on this machine (a dataset name, a hub id: the setting's text is compared instead)."""
    path = Path(path).expanduser()
    if path.is_file():
        return fingerprint_file(path)
    if not path.is_dir():
        return None
    hasher, count, total = xxhash.xxh3_128(), 0, 0
    for file in _folder_files(path):
        printed = fingerprint_file(file)
        hasher.update(f"{file.relative_to(path).as_posix()}={printed};".encode())
        count, total = count + 1, total + int(printed.partition(":")[0])
    return f"{count} files, {total}:{hasher.hexdigest()}"


def _folder_files(path: Path):
    """The first MAX_FOLDER_FILES regular files under `path` in sorted order (links followed: a hub cache snapshot),
    skipping hidden entries (`.cache/huggingface/` metadata that `huggingface-cli download` rewrites)."""
    count = 0
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            file = Path(root) / name
            if file.is_file():
                yield file
                count += 1
                if count == MAX_FOLDER_FILES:
                    return


def _paths_of(key: str, value: str, *, megatron: bool) -> list[Path]:
    """The files a path setting stands for: a Megatron corpus prefix is its .bin and .idx."""
    if megatron and (key == "data.path" or key.startswith("data.blend.") or key.startswith("data.mix.")):
        return [Path(f"{value}.bin"), Path(f"{value}.idx")]
    return [Path(value)]


def identity_of(spec, *, fingerprints: bool = True) -> dict:
    """This spec's identity: its settings (FREE left out) and, with `fingerprints`, its files' fingerprints
    (without: a run of an older dsmt, whose files are no longer known)."""
    from toolkit.spec.layout import derive_layout

    raw = spec.model_dump(mode="json")
    settings = {key: value for key, value in flatten(raw).items() if not _free(key)}
    # the global batch the layout derives (global_batch_tokens / seq_length, or the default): what the data
    # position and the LR schedule count in
    try:
        settings["training.global_batch_size"] = derive_layout(spec).global_batch_size
    except DsmtError:
        pass  # a layout that does not derive is refused by the checks; the settings above still compare
    files = {}
    if fingerprints:
        megatron = bool(spec.data.is_megatron)
        for key, value in settings.items():
            if isinstance(value, str) and _matches(key, PATH_KEYS):
                prints = [fingerprint_path(p) for p in _paths_of(key, value, megatron=megatron)]
                if all(prints):
                    files[key] = " + ".join(prints)
    return {"format": FORMAT, "settings": settings, "files": files, "spec": raw}


def differences(*, recorded: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, recorded value, current value) of every setting or file that differs; a path setting whose file has
    the same fingerprint under another name does not differ."""
    old, new = recorded.get("settings", {}), current["settings"]
    old_files, new_files = recorded.get("files", {}), current["files"]
    found = []
    for key in sorted(set(old) | set(new)):
        if _free(key) or ((key not in old or key not in new) and not _indexed(key)):
            continue  # a setting one of the two dsmt versions does not have (a list entry counts: mix, blend)
        if key in old_files and key in new_files:
            if old_files[key] != new_files[key]:
                found.append((key, f"{old.get(key)} ({old_files[key]})", f"{new.get(key)} ({new_files[key]})"))
        elif old.get(key, "(not set)") != new.get(key, "(not set)"):
            found.append((key, old.get(key, "(not set)"), new.get(key, "(not set)")))
    return found


def _indexed(key: str) -> bool:
    return any(part.isdigit() for part in key.split("."))


def _as_this_version(recorded: dict) -> dict:
    """The record's settings as this dsmt reads the spec it holds: a field added since it was written gets its
    default, so an upgrade does not make every output directory another job's. A spec this dsmt no longer accepts
    keeps the record's own settings (compared where both versions have them)."""
    from toolkit.spec.load import validate_spec

    if not isinstance(recorded.get("spec"), dict):
        return recorded
    try:
        spec = validate_spec(recorded["spec"], source=IDENTITY_FILE)
    except DsmtError:
        return recorded
    return {**recorded, "settings": identity_of(spec, fingerprints=False)["settings"]}


def holds_a_run(output_dir: Path) -> bool:
    """Whether `output_dir` holds what a run made: a complete checkpoint or an export."""
    output_dir = Path(output_dir)
    if any((output_dir / name).exists() for name in ("final-hf", "final-mcore", "final-hf-adapter")):
        return True
    return any((output_dir / "checkpoints").glob("step_*/dsmt_complete.json"))


def recorded_identity(output_dir: Path) -> dict | None:
    """The identity recorded in `output_dir`: dsmt_run.json, or for a run of an older dsmt its
    resolved/job.resolved.yaml (settings only); None when neither is there."""
    from toolkit.spec.load import load_spec

    path = Path(output_dir) / IDENTITY_FILE
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise RuleError(f"{path} is unreadable ({err}): it records which job this output directory belongs "
                            "to", rule=RULE, fix=RECORD_FIX) from None
        if not isinstance(recorded, dict) or not isinstance(recorded.get("settings"), dict):
            raise RuleError(f"{path} is not a run record (no settings)", rule=RULE, fix=RECORD_FIX)
        return _as_this_version(recorded)
    legacy = Path(output_dir) / "resolved" / "job.resolved.yaml"
    if legacy.is_file():
        try:
            return identity_of(load_spec(legacy), fingerprints=False)
        except DsmtError:
            return None  # written by a dsmt whose spec no longer loads: nothing to compare
    return None


def _note(key: str, old) -> str:
    if key == "training.global_batch_size":
        return f"  (derived from the layout when not set: set training.global_batch_size: {old} to keep it)"
    return "  (may change with --continue-with-changes)" if _matches(key, CHANGEABLE) else ""


def refusal(*, output_dir: Path, found: list, allow_changes: bool) -> RuleError | None:
    """The refusal for the differences `found`, or None when they may continue."""
    blocking = [item for item in found if not (allow_changes and _matches(item[0], CHANGEABLE))]
    if not blocking:
        return None
    lines = "\n".join(f"  {key}: {old!r} -> {new!r}" + _note(key, old) for key, old, new in blocking)
    changeable_only = all(_matches(key, CHANGEABLE) for key, _, _ in blocking)
    ways = ("train into a new training.output_dir (the exported final-hf of this one can be its model.path)"
            + ("; or, to continue this run with these changes on purpose, add --continue-with-changes (to "
               "`dsmt train`, or to the `python -m toolkit.train` line of a generated launch script)"
               if changeable_only else "; --continue-with-changes accepts only train_steps, min_lr, evaluation "
               "and layout changes, not these"))
    return RuleError(f"{output_dir} holds the checkpoints of another job: this spec differs from the one that wrote "
                     f"them in {len(blocking)} setting(s); nothing was started\n{lines}", rule=RULE, fix=ways)


def check(*, spec, allow_changes: bool = False) -> tuple[dict | None, list]:
    """(this spec's identity, the accepted differences) when the spec may train into its output_dir (identity None:
    nothing there to compare with, none computed); raises DsmtError `another_run_in_output_dir` naming every
    difference otherwise. Reads only."""
    output_dir = Path(spec.training.output_dir).expanduser()
    recorded = recorded_identity(output_dir) if holds_a_run(output_dir) else None
    if recorded is None:
        return None, []
    current = identity_of(spec)
    found = differences(recorded=recorded, current=current)
    refused = refusal(output_dir=output_dir, found=found, allow_changes=allow_changes)
    if refused is not None:
        raise refused
    return current, found


def admit(*, spec, allow_changes: bool = False) -> list:
    """`check`, then record this spec as the output directory's job (atomically; the accepted changes appended
    to its history). Call it holding the directory's run lock, before any rank starts. The accepted differences."""
    output_dir = Path(spec.training.output_dir).expanduser()
    current, found = check(spec=spec, allow_changes=allow_changes)
    current = current or identity_of(spec)
    path = output_dir / IDENTITY_FILE
    previous = json.loads(path.read_text()) if path.is_file() and holds_a_run(output_dir) else {}
    changes = list(previous.get("changes", []))
    if found:
        changes.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "keys": [key for key, _, _ in found]})
    output_dir.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{IDENTITY_FILE}.tmp-{os.getpid()}")
    staged.write_text(json.dumps({**current, "changes": changes}, indent=1, default=str) + "\n")
    os.replace(staged, path)
    return found


def accepted_lines(found: list) -> list[str]:
    return [f"dsmt train: continuing with changes (--continue-with-changes): {key} {old!r} -> {new!r}"
            for key, old, new in found]


def problems(*, spec, allow_changes: bool = False) -> list:
    """`check` as the dry run's problems (none, or the refusal)."""
    from toolkit.errors import Problem

    try:
        check(spec=spec, allow_changes=allow_changes)
    except RuleError as err:
        return [Problem("error", err.rule, err.detail, err.fix)]
    return []
