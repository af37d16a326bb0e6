"""Checksummed checkpoints: a manifest of every file of a tag (size and xxh3_128 digest), written before the
completion marker, so a tag that was truncated, overwritten or bit-rotted after its save is found before a resume
loads it (DeepSpeed and torch.load notice some of this, late and unnamed; a flipped bit in a tensor, never).

    <tag>/dsmt_manifest.json   {"format": 1, "digest": "xxh3_128", "files": {relpath: {"size", "xxh3_128"}},
                                "total_bytes": N}
    <tag>/dsmt_complete.json   written after the manifest (toolkit/train/checkpoint/checkpoints.py): the save's
                               record, the manifest's digest and its own digest (`marker_text`)
    latest_complete            beside the tags: the newest tag as the last save saw it, a hint only

What a tag is worth is decided here, once, for `dsmt checkpoint verify` and for resume alike (`expected` +
`check_entries` -> `judge`): the marker must be a readable record of this tag's step whose own digest holds, the
manifest must be the one the marker recorded, and every file must match the manifest. A resume takes the newest
tag that passes, whatever `latest_complete` says: that pointer is rewritten after each save's rename, so a save
interrupted in between leaves it one tag behind, and an edited one would silently rewind a run; when it names
another tag than the one taken, both verify and resume say so (`pointer_note`).

xxh3_128 rather than a cryptographic hash: the threat is a damaged disk or an interrupted copy, not an adversary,
and it hashes at memory speed (benchmarks/manifest_cost.py compares it to zlib.crc32). Each rank hashes one
`share` of the files, balanced by bytes, and rank 0 writes the union.

Pure file functions: no torch, no process group (the CLI imports this module)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import xxhash

from toolkit.data.files import digest_file  # shared with `dsmt data prepare`'s corpus sidecar
from toolkit.errors import DsmtError
from toolkit.train.checkpoint.folders import TAG, tag_order, tag_step

MANIFEST = "dsmt_manifest.json"
COMPLETE_MARKER = "dsmt_complete.json"  # checkpoints.COMPLETE_MARKER (that module imports torch)
LATEST = "latest_complete"  # checkpoints.LATEST
MARKER_REQUIRED = {"step": int, "world_size": int}  # what a resume reads from the marker
USABLE = ("intact", "no_manifest")  # the verdicts a resume takes (`judge`)
PARTIAL_PREFIX = ".partial-"  # an interrupted save's directory in the checkpoints dir
FORMAT = 1


def list_files(tag_dir: Path) -> list[str]:
    """Every regular file under `tag_dir` as a sorted relative POSIX path, except the manifest (it cannot list
    itself), a manifest temp file a crash left, and the completion marker (written after the manifest)."""
    tag_dir = Path(tag_dir)
    names = (path.relative_to(tag_dir).as_posix() for path in tag_dir.rglob("*") if path.is_file())
    return sorted(name for name in names
                  if name not in (MANIFEST, COMPLETE_MARKER) and not name.startswith(f".{MANIFEST}"))


def share(files: list[str], sizes: list[int], *, rank: int, world_size: int) -> list[str]:
    """The files `rank` hashes: largest first to the least-loaded rank (ties: the lower rank), so every rank reads
    about the same bytes and the slowest rank sets the manifest's cost. The same on every rank whatever the order
    of `files` (sorted by size, then name); every file in exactly one share."""
    if len(files) != len(sizes):
        raise DsmtError(f"share: {len(files)} files but {len(sizes)} sizes; give one size per file")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DsmtError(f"share: rank={rank}, world_size={world_size}; need world_size >= 1 and "
                        f"0 <= rank < world_size")
    return balanced(dict(zip(files, sizes, strict=True)), candidates=lambda name: range(world_size), rank=rank,
                    world_size=world_size)


def balanced(sizes: dict[str, int], *, candidates, rank: int, world_size: int) -> list[str]:
    """The files of `sizes` that `rank` takes when each goes, largest first (ties: by name), to the least-loaded
    rank (ties: the lower) of `candidates(name)`: the same answer on every rank, each file to exactly one rank."""
    loads = [0] * world_size
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        target = min(candidates(name), key=lambda r: (loads[r], r))
        loads[target] += size
        if target == rank:
            mine.append(name)
    return sorted(mine)


def entries_for(tag_dir: Path, files: list[str]) -> dict[str, dict]:
    """{relpath: {"size": bytes, "xxh3_128": hex}} for `files` (relative to `tag_dir`)."""
    tag_dir = Path(tag_dir)
    return {name: {"size": (tag_dir / name).stat().st_size, "xxh3_128": digest_file(tag_dir / name)}
            for name in files}


def write_manifest(tag_dir: Path, entries: dict) -> None:
    """Write the manifest through a temp file and os.replace: a crash leaves the old manifest or the new one, never
    half of one. Not fsynced, like the checkpoint's own files (DeepSpeed and dist_checkpointing do not sync theirs,
    and syncing this one would flush the whole checkpoint on ext4): a checkpoint torn by a power loss does not match
    its manifest, and a resume falls back to an older one."""
    tag_dir = Path(tag_dir)
    record = {"format": FORMAT, "digest": "xxh3_128", "files": dict(sorted(entries.items())),
              "total_bytes": sum(int(entry["size"]) for entry in entries.values())}
    temp = tag_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    temp.write_text(json.dumps(record, indent=1))
    os.replace(temp, tag_dir / MANIFEST)


def read_manifest(tag_dir: Path) -> dict | None:
    """The manifest of `tag_dir`, None when it has none (written before dsmt checksummed its checkpoints)."""
    path = Path(tag_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DsmtError(f"{path} is not readable JSON ({err}): the manifest itself is damaged; the tag cannot be "
                        f"verified: copy the tag again from its source, or delete it") from err
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("files"), dict):
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise DsmtError(f"{path}: format {found!r}, this dsmt reads format {FORMAT} (a dict with 'files'); "
                        f"verify it with the dsmt that wrote it")
    return record


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str
    kind: str  # missing | size | digest | unlisted | unreadable | malformed (manifest, marker) | unsafe (a pickle)
    expected: int | str | None  # the manifest's size or digest
    found: int | str | None  # what is on disk

    def line(self) -> str:
        if self.kind == "digest":
            return f"{self.file}: digest {self.expected[:8]}..(manifest) != {self.found[:8]}..(on disk)"
        if self.kind == "size":
            how = "truncated or overwritten" if self.found < self.expected else "written to after the save"
            return f"{self.file}: {self.found} bytes on disk, {self.expected} in the manifest ({how})"
        if self.kind == "missing" and self.file == MANIFEST:
            return f"{self.file}: missing, though the completion marker says it was written"
        if self.kind == "missing":
            return f"{self.file}: missing ({self.expected} bytes in the manifest)"
        if self.kind == "unlisted":
            return f"{self.file}: on disk ({self.found} bytes), not in the manifest (added after the save)"
        return f"{self.file}: {self.found}"


def check_entries(tag_dir: Path, entries: dict) -> list[Problem]:
    """The listed files that are missing, of another size, or of another digest. Sizes first: a size mismatch
    is conclusive without reading the file."""
    tag_dir = Path(tag_dir)
    problems = []
    for name, entry in sorted(entries.items()):
        path = tag_dir / name
        if not path.is_file():
            problems.append(Problem(file=name, kind="missing", expected=entry["size"], found=None))
            continue
        try:  # EIO from a damaged disk is a verdict on this file, not a crash of the check
            size = path.stat().st_size
            digest = digest_file(path) if size == entry["size"] else None
        except OSError as err:
            problems.append(Problem(file=name, kind="unreadable", expected=None,
                                    found=f"unreadable ({type(err).__name__}: {err})"))
            continue
        if size != entry["size"]:
            problems.append(Problem(file=name, kind="size", expected=entry["size"], found=size))
            continue
        if digest != entry["xxh3_128"]:
            problems.append(Problem(file=name, kind="digest", expected=entry["xxh3_128"], found=digest))
    return problems


def unlisted(tag_dir: Path, entries: dict) -> list[Problem]:
    """Files on disk the manifest does not list, where a resume would read them: DeepSpeed globs `*.pt` (a stray
    `*_optim_states.pt` changes what it loads) and dist_checkpointing reads its whole folder. Other files (a
    user's `zero_to_fp32` output beside them) are no damage. A resume reads the sharded state's files through its
    index, but a stray one in state/ is named all the same: nothing a save did not write belongs there."""
    tag_dir = Path(tag_dir)
    return [Problem(file=name, kind="unlisted", expected=None, found=(tag_dir / name).stat().st_size)
            for name in list_files(tag_dir)
            if name not in entries and (name.endswith((".pt", ".distcp")) or name.startswith(("layout-free/", "state/")))]


def _record_digest(record: dict) -> str:
    return xxhash.xxh3_128(json.dumps(record, sort_keys=True).encode()).hexdigest()


def marker_text(tag_dir: Path, record: dict) -> str:
    """The completion marker of `tag_dir`: the save's `record` (step, world_size, layout), the digest of the
    manifest just written (so a manifest changed later is not trusted) and the digest of all that (so any change
    to the marker itself is seen, not only a cut that breaks its JSON)."""
    record = dict(record)
    if (Path(tag_dir) / MANIFEST).is_file():
        record["manifest_xxh3_128"] = digest_file(Path(tag_dir) / MANIFEST)
    return json.dumps({**record, "xxh3_128": _record_digest(record)})


def marker_problems(tag_dir: Path) -> tuple[dict | None, list[Problem]]:
    """(the marker's record, what is wrong with it): not readable JSON, a required key missing or of another
    type, another step than the tag's, or content that does not match its own digest. Markers of an older dsmt
    carry no digests; they are checked for the rest."""
    tag_dir = Path(tag_dir)
    try:
        record = json.loads((tag_dir / COMPLETE_MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, [Problem(file=COMPLETE_MARKER, kind="unreadable", expected=None,
                              found=f"not readable JSON ({type(err).__name__}: {err})")]
    if not isinstance(record, dict):
        return None, [Problem(file=COMPLETE_MARKER, kind="malformed", expected=None,
                              found=f"a JSON {type(record).__name__}, not the save's record")]
    problems = []
    wrong = [f"{key} ({kind.__name__})" for key, kind in MARKER_REQUIRED.items() if type(record.get(key)) is not kind]
    if wrong:
        problems.append(f"missing or malformed: {', '.join(wrong)}")
    elif TAG.fullmatch(tag_dir.name) and record["step"] != tag_step(tag_dir.name):
        problems.append(f"records step {record['step']}, not this tag's (a marker of another checkpoint)")
    digest = record.get("xxh3_128")
    if digest is not None and digest != _record_digest({k: v for k, v in record.items() if k != "xxh3_128"}):
        problems.append("its content does not match its own digest (changed after the save)")
    return (None if wrong else record), [Problem(file=COMPLETE_MARKER, kind="malformed", expected=None, found=line)
                                         for line in problems]


def read_marker(tag_dir: Path) -> dict:
    """The marker's record, or DsmtError naming what is wrong (a resume reads it only after `expected` passed)."""
    record, problems = marker_problems(tag_dir)
    if problems:
        raise DsmtError(f"[checkpoint_damaged] {Path(tag_dir) / COMPLETE_MARKER}: {problems[0].found}\nfix: "
                        f"`dsmt checkpoint verify {Path(tag_dir).parent}` lists every checkpoint's state; resume "
                        "again to fall back to the newest intact one")
    return record


def pointer_note(checkpoint_dir: Path, *, taken: str | None) -> str | None:
    """One line when `latest_complete` names another tag than `taken` (the one a resume takes), else None."""
    pointer = Path(checkpoint_dir) / LATEST
    try:
        named = pointer.read_text().strip()
    except FileNotFoundError:
        return None  # a first save cut before it wrote the pointer, or an older dsmt's directory
    except (OSError, UnicodeDecodeError) as err:
        named = f"<unreadable: {type(err).__name__}>"
    if named == taken:
        return None
    if TAG.fullmatch(named) and taken is not None and tag_step(named) < tag_step(taken):
        what = "an older checkpoint (a save cut between its rename and the pointer, or an edited pointer)"
    elif not (TAG.fullmatch(named) and (Path(checkpoint_dir) / named / COMPLETE_MARKER).is_file()):
        what = "no complete checkpoint"
    else:
        what = "a checkpoint that is not intact"
    then = f"a resume takes {taken}, the newest intact one" if taken else "a resume starts from step 0"
    return (f"{pointer} names {named!r}, {what}; {then} (the pointer is only a hint, rewritten at the next "
            "save)")


@dataclasses.dataclass
class TagVerdict:
    tag: str
    status: str  # intact | damaged | no_manifest | incomplete | unsafe
    problems: list[Problem]
    total_bytes: int
    seconds: float
    files: int = 0


def _disk_bytes(tag_dir: Path) -> tuple[int, int]:
    """(file count, bytes) of the files `list_files` sees."""
    files = list_files(tag_dir)
    return len(files), sum((Path(tag_dir) / name).stat().st_size for name in files)


def expected(tag_dir: Path) -> tuple[dict | None, list[Problem]]:
    """(the manifest's entries, what is wrong before any file is hashed) of a complete tag: the marker's problems
    (`marker_problems`), a manifest that cannot be read or is not the one the marker recorded, and the unlisted
    files a resume would read. Entries None: no usable manifest, which is damage (a problem) when the marker says
    one was written or the manifest cannot be read, else a checkpoint from before dsmt wrote manifests."""
    tag_dir = Path(tag_dir)
    marker, problems = marker_problems(tag_dir)
    try:
        manifest = read_manifest(tag_dir)
        entries = None if manifest is None else {
            str(name): {"size": int(entry["size"]), "xxh3_128": str(entry["xxh3_128"])}
            for name, entry in manifest["files"].items()}
        manifest_digest = None if manifest is None else digest_file(tag_dir / MANIFEST)
    except (DsmtError, OSError, KeyError, TypeError, ValueError, AttributeError) as err:
        found = str(err) if isinstance(err, DsmtError) else f"malformed entries ({type(err).__name__}: {err})"
        return None, problems + [Problem(file=MANIFEST, kind="unreadable", expected=None, found=found)]
    if entries is None:
        promised = marker is None or marker.get("manifest")  # deleted, or not copied
        return None, problems + ([Problem(file=MANIFEST, kind="missing", expected="written", found=None)]
                                 if promised else [])
    recorded = (marker or {}).get("manifest_xxh3_128")
    if recorded is not None and manifest_digest != recorded:
        problems.append(Problem(file=MANIFEST, kind="malformed", expected=recorded, found=(
            f"not the manifest {COMPLETE_MARKER} recorded (its digest differs: changed after the save)")))
    return entries, problems + unlisted(tag_dir, entries)


def judge(*, entries: dict | None, problems: list) -> str:
    """The verdict on a complete tag, the one `dsmt checkpoint verify` prints and a resume acts on: `damaged` with
    any problem, else `intact` (it has a manifest) or `no_manifest` (written before dsmt wrote manifests: nothing
    says it is wrong). A resume takes the newest tag whose verdict is in USABLE."""
    if problems:
        return "damaged"
    return "intact" if entries is not None else "no_manifest"


def verify_tag(tag_dir: Path) -> TagVerdict:
    """Check one tag against its manifest. `incomplete`: no completion marker, or a `.partial-*` directory (the save
    did not finish; nothing to verify); else `judge`'s verdict, and `unsafe` for a tag a resume would take but
    refuses to unpickle (toolkit/train/checkpoint/pickles.py; torch is imported for that check only)."""
    tag_dir = Path(tag_dir)
    started = time.perf_counter()
    entries, problems, status = None, [], "incomplete"
    if (tag_dir / COMPLETE_MARKER).is_file() and not tag_dir.name.startswith(PARTIAL_PREFIX):
        entries, problems = expected(tag_dir)
        if entries is not None:
            problems = check_entries(tag_dir, entries) + problems
        status = judge(entries=entries, problems=problems)
    if status in USABLE:
        from toolkit.train.checkpoint.pickles import unsafe_files

        unsafe = [Problem(file=name, kind="unsafe", expected=None, found=what) for name, what in unsafe_files(tag_dir)]
        if unsafe:
            status, problems = "unsafe", unsafe
    if entries is None:
        count, size = _disk_bytes(tag_dir)
    else:
        count, size = len(entries), sum(entry["size"] for entry in entries.values())
    return TagVerdict(tag=tag_dir.name, status=status, problems=problems, total_bytes=size,
                      seconds=time.perf_counter() - started, files=count)


def checkpoints_dir_of(path: Path) -> Path | None:
    """The checkpoints dir `path` names (a run's output dir or the checkpoints dir itself); None for a tag dir."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if TAG.fullmatch(path.name) or path.name.startswith(PARTIAL_PREFIX):
        return None
    if any(child.is_dir() and (TAG.fullmatch(child.name) or child.name.startswith(PARTIAL_PREFIX))
           for child in path.iterdir()):
        return path
    raise DsmtError(f"{path} holds no checkpoints: expected a run's output directory (with checkpoints/), a "
                    f"checkpoints directory (with step_NNNNNN tags) or one tag directory (step_NNNNNN)")


def verify_run(path: Path) -> list[TagVerdict]:
    """Verify every tag under `path` (output dir, checkpoints dir or one tag dir), oldest step first, then the
    `.partial-*` directories interrupted saves left (always `incomplete`: they never became a tag)."""
    path = Path(path)
    if not path.is_dir():
        raise DsmtError(f"{path} is not a directory: give a run's output directory, its checkpoints/ directory or "
                        f"one tag directory (step_NNNNNN)")
    checkpoint_dir = checkpoints_dir_of(path)
    if checkpoint_dir is None:
        return [verify_tag(path)]
    children = [child for child in checkpoint_dir.iterdir() if child.is_dir()]
    tags = sorted((child for child in children if TAG.fullmatch(child.name)),
                  key=lambda child: tag_order(child.name))
    partials = sorted(child for child in children if child.name.startswith(PARTIAL_PREFIX))
    return [verify_tag(tag) for tag in tags] + [verify_tag(partial) for partial in partials]


def tag_bytes(tag_dir: Path) -> int:
    """The bytes a tag holds: the manifest's total, else the files' sizes (an estimate for the free-space check
    before the next save: a damaged manifest must not stop a save, so it falls back too)."""
    try:
        manifest = read_manifest(tag_dir)
    except DsmtError:
        manifest = None
    if manifest is not None:
        return int(manifest["total_bytes"])
    return _disk_bytes(tag_dir)[1]
