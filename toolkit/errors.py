"""The one exception type users see: the CLI prints its message and exits non-zero, without a traceback; the
problems a check finds, collected into one report (text for people, JSON for tools); and what every writer needs
to say "the disk is full" instead of a library's traceback. The bottom floor: every package may import it."""

from __future__ import annotations

import dataclasses
import errno
from typing import Literal


class DsmtError(Exception):
    """An error with an actionable message: the rule broken, the values seen, and the fix."""

    exit_code = 2


class RuleError(DsmtError):
    """`[rule] detail`, then `fix: ...`, with the parts kept (`rule`, `detail`, `fix`) so that a report lists it as
    one Problem (below) without reading them back out of the text."""

    def __init__(self, detail: str, *, rule: str, fix: str = ""):
        super().__init__(f"[{rule}] {detail}" + (f"\nfix: {fix}" if fix else ""))
        self.rule, self.detail, self.fix = rule, detail, fix


Severity = Literal["error", "warning", "info"]


@dataclasses.dataclass(frozen=True)
class Problem:
    severity: Severity
    rule: str  # stable name, e.g. "heads_vs_tp"
    message: str  # the rule and the values seen
    fix: str = ""  # what to change; valid alternatives
    valid: tuple = ()  # the valid values of the setting the rule is about (e.g. tp sizes), when it has a list


@dataclasses.dataclass(frozen=True)
class Report:
    source: str
    problems: tuple[Problem, ...]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def rules(self, severity: Severity = "error") -> set[str]:
        return {p.rule for p in self.problems if p.severity == severity}

    def to_text(self) -> str:
        counts = {s: sum(p.severity == s for p in self.problems) for s in ("error", "warning", "info")}
        head = f"{self.source}: {'OK' if self.ok else 'FAILED'} ({counts['error']} errors, {counts['warning']} warnings)"
        lines = [head]
        for problem in sorted(self.problems, key=lambda p: ("error", "warning", "info").index(p.severity)):
            lines.append(f"  {problem.severity:<7} [{problem.rule}] {problem.message}")
            if problem.fix:
                lines.append(f"          fix: {problem.fix}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"source": self.source, "ok": self.ok, "problems": [dataclasses.asdict(p) for p in self.problems]}


class SpecError(DsmtError):
    """A spec that cannot be loaded or fails its checks; carries every problem found."""

    exit_code = 2  # bad input, as every dsmt refusal

    def __init__(self, report: Report):
        self.report = report
        super().__init__(report.to_text())


def disk_full_cause(err: BaseException) -> BaseException | None:
    """The failure behind `err` that says the disk is full: ENOSPC / EDQUOT, else the words "No space left" (Rust
    writers: safetensors), searched through `err`, its causes and contexts and every rank's failure a wrapper
    carries (torch.distributed.checkpoint's CheckpointException: `failures`, rank -> (exception, traceback)). The
    wrapper itself is never the answer: it names the rank that hit the full disk first, the disk is full for all."""
    causes = failure_chain(err)
    by_errno = [e for e in causes if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)]
    return (by_errno or [e for e in causes if "No space left" in str(e)] or [None])[0]


def failure_chain(err: BaseException) -> list[BaseException]:
    """`err`, its causes and contexts and the failures it carries, depth first, wrappers of failures left out."""
    return [e for e in _chain(err) if not isinstance(getattr(e, "failures", None), dict)]


def _chain(err: BaseException, seen: set[int] | None = None):
    """`err`, its causes and contexts, and the failures it carries, depth first, each once: a carried failure's
    context may lead back to its wrapper."""
    seen = set() if seen is None else seen
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        failures = getattr(err, "failures", None)
        for inner in failures.values() if isinstance(failures, dict) else ():
            inner = inner[0] if isinstance(inner, tuple) and inner else inner
            if isinstance(inner, BaseException):
                yield from _chain(inner, seen)
        err = err.__cause__ or err.__context__
