"""`dsmt checkpoint verify DIR [--json]`: check every checkpoint tag under DIR (a run's output directory, its
checkpoints/ directory or one step_NNNNNN tag) against its manifest (toolkit/train/checkpoint/manifest.py), before a
resume, after a copy between machines, or when a run's disk had trouble.

Exit 0 when every complete tag is intact (or predates manifests), 1 when one is damaged (its marker, its manifest or
a file) or holds a pickle a resume refuses (`unsafe`), 2 for a path that holds no checkpoints. The verdicts are the
ones a resume acts on (`manifest.judge`, `pickles.unsafe_files`), and the tag a resume would take is named, with the
`latest_complete` pointer when it names another. Cheap to import: no torch (the pickle check imports it to run)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from toolkit.train.checkpoint.manifest import USABLE

SHOWN_PROBLEMS = 10  # per tag; a tag copied from the wrong run would otherwise print every file


def register(subparsers) -> None:
    parser = subparsers.add_parser("checkpoint", help="inspect training checkpoints (verify their checksums)")
    commands = parser.add_subparsers(dest="checkpoint_command", required=True, metavar="ACTION")
    verify = commands.add_parser("verify", help="check every tag under DIR against its manifest; exit 1 when one "
                                 "is damaged")
    verify.add_argument("dir", type=Path, metavar="DIR",
                        help="a run's output directory, its checkpoints/ directory, or one tag (step_NNNNNN)")
    verify.add_argument("--json", action="store_true", help="print the verdicts as JSON (every problem listed)")
    verify.set_defaults(func=run_verify)


def run_verify(args) -> int:
    from toolkit.train.checkpoint.manifest import verify_run

    from toolkit.train.checkpoint.manifest import checkpoints_dir_of, pointer_note

    verdicts = verify_run(args.dir)
    checkpoint_dir = checkpoints_dir_of(Path(args.dir))  # None for one tag: no pointer to compare
    note = pointer_note(checkpoint_dir, taken=resume_tag(verdicts)) if checkpoint_dir is not None else None
    if args.json:
        print(json.dumps([dataclasses.asdict(verdict) for verdict in verdicts], indent=2))
    else:
        print(report(verdicts, path=args.dir) + (f"\n{note}" if note else ""))
    return 1 if any(verdict.status in ("damaged", "unsafe") for verdict in verdicts) else 0


def tag_lines(verdict, *, width: int) -> list[str]:
    """One line per tag; a damaged tag's further problems on the lines below, indented under the first."""
    name = verdict.tag.ljust(width)
    if verdict.status == "intact":
        size = f"{verdict.total_bytes / 1e6:.1f} MB"
        return [f"{name}  intact   {size}  ({verdict.files} files, {verdict.seconds:.2f} s)"]
    if verdict.status == "no_manifest":
        return [f"{name}  no manifest (written before dsmt checksummed its checkpoints): not verified"]
    if verdict.status == "incomplete":
        if verdict.tag.startswith("step_"):
            return [f"{name}  incomplete (no dsmt_complete.json: an interrupted save; never resumed from, removed "
                    f"at the next save or resume)"]
        return [f"{name}  incomplete (an interrupted save; removed at the next save or resume)"]
    lines = [problem.line() for problem in verdict.problems[:SHOWN_PROBLEMS]]
    if len(verdict.problems) > SHOWN_PROBLEMS:
        lines.append(f"and {len(verdict.problems) - SHOWN_PROBLEMS} more problems (--json lists every one)")
    state = "DAMAGED" if verdict.status == "damaged" else "UNSAFE "
    return [f"{name}  {state}  {lines[0]}", *(f"{' ' * width}           {line}" for line in lines[1:])]


def resume_tag(verdicts) -> str | None:
    """The tag a resume takes: the newest complete one that is not damaged (a resume sets damaged ones aside and
    falls back), whether intact, without a manifest (nothing says it is wrong) or unsafe (a resume stops there)."""
    usable = [verdict.tag for verdict in verdicts if verdict.status in (*USABLE, "unsafe")]
    return usable[-1] if usable else None


def summary(verdicts) -> str:
    damaged = [verdict.tag for verdict in verdicts if verdict.status == "damaged"]
    newest = resume_tag(verdicts)
    unverified = {verdict.tag for verdict in verdicts if verdict.status == "no_manifest"}
    unsafe = {verdict.tag for verdict in verdicts if verdict.status == "unsafe"}
    if newest is None and damaged:
        line = ("no intact checkpoint: a resume stops with checkpoint_damaged (restore the files, or move the "
                "checkpoints aside to start from the model)")
    elif newest is None:
        line = "no complete checkpoint: a resume would start from step 0"
    elif newest in unsafe:
        line = (f"newest undamaged: {newest}, which holds a pickle that would run code: a resume stops there "
                "with unsafe_checkpoint")
    elif newest in unverified:
        line = f"newest usable: {newest} (not verified: no manifest), the tag a resume would take"
    else:
        line = f"newest intact: {newest}, the tag a resume would take"
    if damaged:
        line += (f"; damaged: {', '.join(damaged)}: copy each again from its source, or delete it so that nothing "
                 f"can load it")
    return line


def report(verdicts, *, path: Path) -> str:
    if not verdicts:
        return f"no checkpoint tags under {path}: a resume would start from step 0"
    width = max(len(verdict.tag) for verdict in verdicts)
    lines = [line for verdict in verdicts for line in tag_lines(verdict, width=width)]
    return "\n".join([*lines, summary(verdicts)])
