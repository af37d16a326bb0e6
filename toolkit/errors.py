"""The one exception type users see: the CLI prints its message and exits non-zero, without a traceback. Also
what every writer needs to say "the disk is full" instead of a library's traceback."""

from __future__ import annotations

import errno


class DsmtError(Exception):
    """An error with an actionable message: the rule broken, the values seen, and the fix."""

    exit_code = 2


class RuleError(DsmtError):
    """`[rule] detail`, then `fix: ...`, with the parts kept (`rule`, `detail`, `fix`) so that a report lists it as
    one Problem (toolkit/spec/report.py) without reading them back out of the text."""

    def __init__(self, detail: str, *, rule: str, fix: str = ""):
        super().__init__(f"[{rule}] {detail}" + (f"\nfix: {fix}" if fix else ""))
        self.rule, self.detail, self.fix = rule, detail, fix


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
