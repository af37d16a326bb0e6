"""Problems found in a job spec, collected into one report (text for people, JSON for tools)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from toolkit.errors import DsmtError

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
