"""What `dsmt demo` leaves behind: its directory (a re-run replaces the demo's own files there and keeps the rest)
and the closing summary that names every file."""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import sys
from pathlib import Path

from toolkit.errors import DsmtError

MARKER = ".dsmt-demo"  # a directory holding it was written by `dsmt demo`, and a re-run may replace it
# Everything the demo writes, by top-level name in its directory (DemoFiles.add refuses any other path); a re-run
# replaces these and keeps anything else, such as the train-tp2/ of the summary's "next:" hint.
DEMO_ENTRIES = (MARKER, "tiny-llama-hf", "tiny-llama-mcore", "verify.json", "tiny-llama-export", "demo-data.jsonl",
                "demo-job.yaml", "plan", "run", "train", "summary.txt")


def replace_workdir(*, workdir: Path, build, own: tuple[str, ...] = DEMO_ENTRIES) -> bool:
    """Run `build()` (True when the demo passed) into `workdir` in place of the previous demo's entries `own`;
    the previous demo comes back if it fails or is interrupted, and what else is in `workdir` (the user's) stays.
    The demo writes into `workdir` itself rather than a staging copy because its files record their own paths (the
    job spec, the run directory's scripts, the megatron checkpoint's source); the old entries are moved aside one
    rename each, deleted after a pass, and renamed back otherwise, so a re-run never mixes the two runs' files. A
    failed run's files are kept in .NAME.failed for a look."""
    _refuse_foreign(workdir)
    previous, failed = workdir.with_name(f".{workdir.name}.previous"), workdir.with_name(f".{workdir.name}.failed")
    shutil.rmtree(previous, ignore_errors=True)  # left by a demo that was killed
    existed = workdir.is_dir()
    workdir.mkdir(parents=True, exist_ok=True)
    kept = sorted(p.name for p in workdir.iterdir() if p.name not in own)
    _move_entries(source=workdir, target=previous, names=own)
    if kept:
        print(f"dsmt demo: keeping what is not the demo's own in {workdir}: {', '.join(kept)}", flush=True)
    (workdir / MARKER).write_text("written by `dsmt demo`; a re-run replaces the demo's own files here and keeps "
                                  "the rest\n")
    passed = False
    try:
        passed = build()
    finally:
        if passed:
            shutil.rmtree(previous, ignore_errors=True)
        else:
            _restore(workdir=workdir, previous=previous, failed=failed, kept=kept, existed=existed)
    return passed


def _move_entries(*, source: Path, target: Path, names) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (source / name).exists() or (source / name).is_symlink():
            (source / name).rename(target / name)


def _restore(*, workdir: Path, previous: Path, failed: Path, kept: list[str], existed: bool) -> None:
    """After a failed or interrupted run: its files to `failed`, the previous demo's back, the user's untouched."""
    shutil.rmtree(failed, ignore_errors=True)
    _move_entries(source=workdir, target=failed, names=[p.name for p in workdir.iterdir() if p.name not in kept])
    if previous.exists():
        _move_entries(source=previous, target=workdir, names=[p.name for p in previous.iterdir()])
        previous.rmdir()
    if not existed and not any(workdir.iterdir()):
        workdir.rmdir()
    print(f"dsmt demo: the failed run's files are in {failed}; {workdir} is as it was", flush=True)


def _refuse_foreign(workdir: Path) -> None:
    """Never replace a directory the demo did not write (`--workdir ~` must not empty a home directory)."""
    if workdir.exists() and not workdir.is_dir():
        raise DsmtError(f"--workdir {workdir} exists and is not a directory; choose another path")
    if workdir.is_dir() and any(workdir.iterdir()) and not (workdir / MARKER).is_file():
        raise DsmtError(f"--workdir {workdir} is not empty and was not written by `dsmt demo` (no {MARKER} file); "
                        "choose a new or empty directory, e.g. --workdir dsmt-demo")


@dataclasses.dataclass
class DemoFiles:
    """The demo's paths, and each file it wrote with one line saying what it is (for summary.txt)."""

    workdir: Path
    written: list[tuple[Path, str]] = dataclasses.field(default_factory=list)

    @property
    def hf(self) -> Path:
        return self.workdir / "tiny-llama-hf"

    @property
    def mcore(self) -> Path:
        return self.workdir / "tiny-llama-mcore"

    @property
    def export(self) -> Path:
        return self.workdir / "tiny-llama-export"

    @property
    def data(self) -> Path:
        return self.workdir / "demo-data.jsonl"

    @property
    def spec(self) -> Path:
        return self.workdir / "demo-job.yaml"

    @property
    def run(self) -> Path:
        return self.workdir / "run"

    @property
    def train(self) -> Path:
        return self.workdir / "train"

    @property
    def trained(self) -> Path:
        return self.train / "final-hf"

    def add(self, path: Path, what: str) -> None:
        if path.relative_to(self.workdir).parts[0] not in DEMO_ENTRIES:
            raise ValueError(f"{path} is not under one of DEMO_ENTRIES, which a re-run replaces; add it there")
        self.written.append((path, what))

    def summary(self, *, passed: bool, seconds: float, samples: tuple[list[str], list[str]], spec: dict,
                losses: tuple[float, float], dsmt: str) -> str:
        """`samples`: the greedy continuations of the prompts before and after the fine-tune; `dsmt` is the command
        that runs dsmt from the user's shell (dsmt_command)."""
        names = [str(path.relative_to(self.workdir)) + ("/" if path.is_dir() else "") for path, _ in self.written]
        width = max(map(len, names))
        lines = [f"dsmt demo {'passed' if passed else 'FAILED'} in {seconds:.0f} s; its files, in {self.workdir}:"]
        lines += [f"  {name:{width}s}  {what}" for name, (_, what) in zip(names, self.written)]
        before, after = samples
        shortened = [old if len(old) <= 24 else old[:21] + "..." for old in before]  # the random start rambles
        lines += ["", f"loss {losses[0]:.3f} -> {losses[1]:.3f} over {spec['training']['train_steps']} steps; "
                      f"greedy samples, before -> after the fine-tune: " + "; ".join(
                          f"{old!r} -> {new!r}" for old, new in zip(shortened, after)),
                  f"next: cd {shlex.quote(str(self.workdir))}; {dsmt} check demo-job.yaml; {dsmt} train demo-job.yaml "
                  "--set parallel.pp=1 --set parallel.tp=2 --set training.output_dir=train-tp2  (the same fine-tune "
                  f"at TP2 x DP2; a re-run of the demo keeps train-tp2/); {dsmt} plan llama3-8b --nodes 2 "
                  "--gpus-per-node 8 --seq-len 4096 --global-batch 256"]
        return "\n".join(lines) + "\n"


def dsmt_command(*, on_path: str | None, executable: str, argv0: str) -> str:
    """The command a hint should name to run this installation's dsmt: `dsmt` when PATH (`on_path`, what
    shutil.which found) leads to this one, else its absolute path; after the README's `bash scripts/bootstrap.sh
    && .venv/bin/dsmt demo` the venv is not activated and a bare `dsmt` is not found, or is another install's."""
    # the script that is running, and the one beside the interpreter; not executable's resolved path: a venv's
    # python is a link to the base interpreter, whose bin/ holds no dsmt
    ours = ([Path(argv0)] if Path(argv0).name == "dsmt" else []) + [Path(executable).parent / "dsmt"]
    ours = [path.absolute() for path in ours if path.is_file()]
    if not ours:
        return f"{shlex.quote(executable)} -m toolkit.cli"
    if on_path and any(Path(on_path).resolve() == path.resolve() for path in ours):
        return "dsmt"
    return shlex.quote(str(ours[0]))


def this_dsmt() -> str:
    """dsmt_command of the running process, read before anything changes the working directory."""
    return dsmt_command(on_path=shutil.which("dsmt"), executable=sys.executable, argv0=sys.argv[0])

