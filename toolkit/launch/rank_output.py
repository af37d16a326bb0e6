"""Who speaks in a run of several ranks: rank 0 on the console, every other rank into its own file, one error.

Four ranks printing the same notices, progress bars and failure drown the one line that matters. So by default:
- rank 0 keeps the console; rank N > 0 writes its stdout and stderr to LOG_DIR/rankN.log (`quiet_other_ranks`);
- a rank that fails writes LOG_DIR/rankN.error.json (`run_rank`). Under dsmt's own launcher (`dsmt train`,
  `dsmt verify`, `dsmt demo`: toolkit/launch/local.py) the launcher prints the first failure once, as a dsmt error, and
  keeps torchrun's own traceback in LOG_DIR/launcher.log; under a cluster launcher each failing rank says it in one
  line on its console;
- `--verbose` (DSMT_VERBOSE=1) keeps every rank on the console, with the libraries' warnings.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from toolkit.errors import DsmtError

VERBOSE_ENV = "DSMT_VERBOSE"  # "1": every rank keeps the console
SHOW_WARNINGS_ENV = "DSMT_SHOW_WARNINGS"  # set: the libraries' warnings and progress bars stay
LOG_DIR_ENV = "DSMT_LOG_DIR"  # set by dsmt's local launcher: where ranks write their logs and error reports
CONSOLE_ENV = "DSMT_CONSOLE_STDERR"  # set by dsmt's local launcher: its own stderr, for rank 0

_log_dir: Path | None = None  # this rank's, once known
_console_fd: int | None = None  # the console's stderr of a rank whose output went to its file
_quieted = False


def verbose() -> bool:
    """`--verbose` (DSMT_VERBOSE=1): every rank keeps the console. The one reading of the switch."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def warnings_shown() -> bool:
    """DSMT_SHOW_WARNINGS (any value) or `--verbose`: the libraries' warnings and progress bars are not hidden."""
    return bool(os.environ.get(SHOW_WARNINGS_ENV)) or verbose()


# Where the pages of fallback / deprecation warnings come from ("Apex is not installed", "all_gather_into_tensor
# is deprecated"): a user's own script keeps its own and other libraries' warnings.
LIBRARY_WARNING_MODULES = r"(megatron|torch\.distributed|deepspeed|transformer_engine)(\.|$)"


def quiet_library_warnings(*, only_libraries: bool = False) -> None:
    """megatron's and torch's fallback and deprecation warnings (pages of them per rank) hidden, as every dsmt
    command and rank hides them, unless DSMT_SHOW_WARNINGS=1 or --verbose; also for processes started by other
    launchers (the generated scripts' ranks: `python -m toolkit.train` calls this before its imports).
    `only_libraries`: just those raised in megatron, torch.distributed, DeepSpeed and Transformer Engine (a user's
    script calling `api.initialize`)."""
    import warnings

    if warnings_shown():
        return
    module = LIBRARY_WARNING_MODULES if only_libraries else ""
    warnings.filterwarnings("ignore", category=UserWarning, module=module)
    warnings.filterwarnings("ignore", category=FutureWarning, module=module)


def this_rank() -> int:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def rank_log(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.log"


def error_report(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.error.json"


def quiet_other_ranks(*, log_dir: Path) -> None:
    """Send this rank's output to log_dir/rankN.log unless it is rank 0 or the run is verbose. Call it once, as
    early as the log directory is known (the launcher's DSMT_LOG_DIR, else the run's output directory)."""
    global _log_dir, _console_fd, _quieted
    if _quieted:
        return
    _quieted = True
    _log_dir = Path(os.environ.get(LOG_DIR_ENV) or log_dir)
    if verbose():
        return
    rank = this_rank()
    if rank == 0:
        _reattach_console_stderr()
        return
    _log_dir.mkdir(parents=True, exist_ok=True)  # only a rank that writes there: a refused run leaves no output
    sys.stdout.flush()
    sys.stderr.flush()
    _console_fd = os.dup(2)
    log_fd = os.open(rank_log(_log_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)  # file descriptors, not sys.stdout: C++ and subprocess output follows too
    os.dup2(log_fd, 2)
    os.close(log_fd)


def _reattach_console_stderr() -> None:
    """dsmt's launcher keeps torchrun's stderr (and so every rank's) for its own report; rank 0 writes to the
    launcher's stderr instead (a terminal, a pipe or a file, reopened through /proc), else to stdout."""
    console = os.environ.get(CONSOLE_ENV)
    if not console:
        return
    sys.stderr.flush()
    try:
        fd = os.open(console, os.O_WRONLY | os.O_APPEND)
    except OSError:  # a socket cannot be reopened
        fd = os.dup(1)
    os.dup2(fd, 2)
    os.close(fd)


def say_on_console(line: str) -> None:
    """One line on this rank's console even when its output goes to its file (a node saying it joined)."""
    if _console_fd is None:
        print(line, flush=True)
    else:
        os.write(_console_fd, (line + "\n").encode())


# Errors a rank sees when ANOTHER rank failed: its connection dropped, or a collective waited for it in vain.
CONSEQUENCES = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out",
                "connection refused", "remote process exited", "communicator was aborted", "socket timeout",
                "watchdog caught collective operation timeout")
REPORT_RESERVE_BYTES = 64 * 1024  # written at start, so a report fits on a disk that fills later


def is_consequence(message: str) -> bool:
    text = message.lower()
    return any(pattern in text for pattern in CONSEQUENCES)


def run_rank(entry, *, command: str) -> int:
    """Run a rank's `entry()` and return its exit code; a failure is reported where the launcher looks for it.
    Under dsmt's launcher the rank is quieted before anything runs; elsewhere `entry` calls `quiet_other_ranks`
    once it knows the run's directory."""
    if os.environ.get(LOG_DIR_ENV):
        quiet_other_ranks(log_dir=Path(os.environ[LOG_DIR_ENV]))
        _reserve_report()
    try:
        code = int(entry() or 0)
        _release_report()
        return code
    except SystemExit:  # an exit on purpose (a preemption's 75): nothing to report
        _release_report()
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - every failure is reported, then the rank exits non-zero
        return report_failure(err, command=command)


def report_failure(err: BaseException, *, command: str) -> int:
    rank, host = this_rank(), socket.gethostname()
    message = str(err) if isinstance(err, DsmtError) else f"{type(err).__name__}: {err}"
    trace = "" if isinstance(err, DsmtError) else traceback.format_exc()
    exit_code = getattr(err, "exit_code", 1)
    under_dsmt_launcher = bool(os.environ.get(LOG_DIR_ENV))
    suspects = _suspects(message, rank=rank)
    if suspects:  # this rank only saw another's fault: name that one
        message += "".join(f"\n  rank {other} failed first: {why}" for other, why in suspects)
    if under_dsmt_launcher and _log_dir is not None:  # the launcher reads it and says it once
        report = {"rank": rank, "host": host, "command": command, "message": message, "traceback": trace,
                  "exit_code": exit_code, "time": time.time(), "consequence": is_consequence(message),
                  "suspects": [other for other, _ in suspects],
                  "suspect_reasons": {str(other): why for other, why in suspects}}
        _write_report(report)
    if not under_dsmt_launcher or verbose() or _console_fd is not None:  # a quiet rank's file keeps the story
        print(f"{trace}{command}: error: rank {rank}: {message}", file=sys.stderr, flush=True)
    if _console_fd is not None and not under_dsmt_launcher:  # and the console gets one line
        where = f" (its output: {rank_log(_log_dir, rank)})" if _log_dir is not None else ""
        os.write(_console_fd, f"{command}: error: rank {rank} on {host}: {message}{where}\n".encode())
    return exit_code


def _suspects(message: str, *, rank: int) -> list[tuple[int, str]]:
    if not is_consequence(message) or _log_dir is None:
        return []
    from toolkit.launch import heartbeat

    return heartbeat.suspects(_log_dir, me=rank)


def _release_report() -> None:
    """The reserved space goes back: nothing to report."""
    if _log_dir is not None:
        error_report(_log_dir, this_rank()).with_suffix(".reserve").unlink(missing_ok=True)


def _reserve_report() -> None:
    """Claim this rank's report space now (real bytes: a sparse file would need blocks later)."""
    if _log_dir is None:
        return
    try:
        _log_dir.mkdir(parents=True, exist_ok=True)
        error_report(_log_dir, this_rank()).with_suffix(".reserve").write_bytes(b" " * REPORT_RESERVE_BYTES)
    except OSError:
        pass


def _write_report(report: dict) -> None:
    """Into the reserved space when there is one (a full disk cannot refuse it), then renamed into place."""
    target = error_report(_log_dir, report["rank"])
    reserve = target.with_suffix(".reserve")
    data = (json.dumps(report, indent=1) + "\n").encode()
    if len(data) > REPORT_RESERVE_BYTES:  # the traceback's tail is what explains
        report = {**report, "traceback": report["traceback"][-(REPORT_RESERVE_BYTES // 2):]}
        data = (json.dumps(report, indent=1) + "\n").encode()[:REPORT_RESERVE_BYTES]
    try:
        if reserve.is_file():
            with open(reserve, "r+b") as file:
                file.write(data)
                file.truncate(len(data))
            os.replace(reserve, target)
        else:
            _log_dir.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    except OSError as err:  # the console still gets the line
        print(f"dsmt: rank {report['rank']}: could not write {target} ({err}): {report['message']}",
              file=sys.stderr, flush=True)


class RankFailure(DsmtError):
    """Ranks started by dsmt failed: the first failure, as the rank reported it."""

    def __init__(self, message: str, *, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def launched_failure(*, log_dir: Path, nprocs: int, returncode: int) -> RankFailure:
    """The error the launcher raises when its ranks failed, naming the rank that failed FIRST: the earliest rank
    whose own error caused it; else the rank the others' reports blame (their peer dropped or a collective timed
    out: toolkit/launch/heartbeat.py); else the rank whose heartbeat stopped long before the others' (NCCL aborts
    from C++, no report); else what torchrun recorded (a rank killed by a signal writes no report)."""
    reports, unreadable = _read_reports(log_dir)
    launcher_log = log_dir / "launcher.log"
    logs = (f"every rank's output: {log_dir}/rank*.log; torchrun's: {launcher_log}" if launcher_log.is_file()
            else "every rank's output is above (--verbose)")
    logs += "".join(f"; {path} is unreadable ({why})" for path, why in unreadable)
    causes = [r for r in reports if not r.get("consequence")]
    if causes:
        return _own_error(min(causes, key=lambda r: r["time"]), nprocs=nprocs, others=len(reports) - 1, logs=logs)
    root = _torchrun_exits(launcher_log, root_cause_only=True)
    blamed = sorted({s for r in reports for s in r.get("suspects", [])})
    if blamed:  # every report is a consequence of a rank that left none (killed, stopped)
        first, exits = min(reports, key=lambda r: r["time"]), _torchrun_exits(launcher_log)
        how = f" ({exits[blamed[0]]})" if blamed[0] in exits else ""
        if _seen_stopped(reports, rank=blamed[0]):  # torchrun's SIGKILL came after, when it ended the job
            how = " (its process was stopped: SIGSTOP or a debugger; it was killed when the job ended)"
        return RankFailure(f"rank {blamed[0]} of {nprocs} failed first{how}, without an error of its own (its "
                           f"output: {rank_log(log_dir, blamed[0])}); rank {first['rank']} on {first['host']} then "
                           f"saw: {first['message']}\n({logs})", exit_code=1)
    stalled = _stalled_first(log_dir)
    if stalled is not None:
        rank, silent_s = stalled
        return RankFailure(f"rank {rank} of {nprocs} stalled first: its heartbeat stopped {silent_s:.0f} s before "
                           f"the other ranks' (its output: {rank_log(log_dir, rank)}); the others then failed "
                           f"waiting for it ({_first_line(reports, root)})\n({logs})", exit_code=1)
    if reports:
        return _own_error(min(reports, key=lambda r: r["time"]), nprocs=nprocs, others=len(reports) - 1, logs=logs)
    if root:  # killed before any rank could report (the launcher stopped the others)
        rank, how = next(iter(root.items()))
        return RankFailure(f"rank {rank} of {nprocs} failed first ({how}), without an error of its own (its "
                           f"output: {rank_log(log_dir, rank)}); the other ranks were stopped\n({logs})",
                           exit_code=1)
    if returncode < 0:  # torchrun itself was killed; its ranks stop on their own (watchdog.py)
        return RankFailure(f"torchrun, the launcher of the {nprocs} ranks, was {_exit_words(returncode)}; its ranks "
                           f"stop when they see it gone\n({logs})", exit_code=1)
    return RankFailure(f"{nprocs} ranks failed (torchrun exit {returncode}) before reporting an error: "
                       f"{_torchrun_root_cause(launcher_log)}\n({logs})", exit_code=1)


def _own_error(first: dict, *, nprocs: int, others: int, logs: str) -> RankFailure:
    also = f"; {others} other rank(s) failed too" if others else ""
    trace = f"\n{first['traceback'].rstrip()}" if first["traceback"] else ""  # a bug, not a dsmt error: where
    return RankFailure(f"rank {first['rank']} of {nprocs} on {first['host']}: {first['message']}{trace}"
                       f"\n({logs}{also})", exit_code=int(first["exit_code"]) or 1)


def _seen_stopped(reports: list[dict], *, rank: int) -> bool:
    from toolkit.launch.heartbeat import STOPPED_PROCESS

    return any(r.get("suspect_reasons", {}).get(str(rank), "").startswith(STOPPED_PROCESS) for r in reports)


def _stalled_first(log_dir: Path) -> tuple[int, float] | None:
    from toolkit.launch import heartbeat

    return heartbeat.earliest_silent(log_dir)


def _first_line(reports: list[dict], root: dict[int, str]) -> str:
    if reports:
        first = min(reports, key=lambda r: r["time"])
        return f"rank {first['rank']}: {first['message'].splitlines()[0]}"
    return ", ".join(f"rank {rank} {how}" for rank, how in root.items()) or "no rank reported"


def _read_reports(log_dir: Path) -> tuple[list[dict], list[tuple[Path, str]]]:
    reports, unreadable = [], []
    for path in sorted(log_dir.glob("rank*.error.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:  # a report cut short (a disk that was full before it was reserved)
            unreadable.append((path, f"{type(err).__name__}: {err}"))
    return reports, unreadable


def _torchrun_exits(launcher_log: Path, *, root_cause_only: bool = False) -> dict[int, str]:
    """rank -> "exit code N" / "killed by SIGKILL" from torchrun's failure list (or a plugged rank runner's, in
    torchrun's words); with `root_cause_only` the first observed failure's rank alone (torchrun prints it last)."""
    if not launcher_log.is_file():
        return {}
    import re

    lines = launcher_log.read_text(errors="replace").splitlines()
    if root_cause_only:
        lines = lines[next((i for i, line in enumerate(lines) if "Root Cause" in line), len(lines)):]
    exits, rank = {}, None
    for line in lines:
        if (found := re.match(r"\s*rank\s*:\s*(\d+)", line)):
            rank = int(found.group(1))
        elif rank is not None and (found := re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)):
            code = int(found.group(1))
            exits.setdefault(rank, _exit_words(code))
            if root_cause_only:
                break
            rank = None
    return exits


def _exit_words(code: int) -> str:
    import signal

    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _torchrun_root_cause(launcher_log: Path) -> str:
    """The rank, exit code and signal of torchrun's 'Root Cause' block, in one line."""
    if not launcher_log.is_file():
        return "no launcher log"
    lines = launcher_log.read_text(errors="replace").splitlines()
    fields = {}
    for line in lines[next((i for i, l in enumerate(lines) if "Root Cause" in l), len(lines)):]:
        name, _, value = line.strip().partition(":")
        if name.strip() in ("rank", "exitcode", "traceback") and name.strip() not in fields:
            fields[name.strip()] = value.strip()
    if not fields:
        return " / ".join(lines[-3:]) or "torchrun printed nothing"
    return ", ".join(f"{name} {value}" for name, value in fields.items())


def clear_reports(log_dir: Path) -> None:
    """A new launch into the same directory: the previous launch's logs and error reports are not this one's."""
    for path in [*log_dir.glob("rank*.error.json"), *log_dir.glob("rank*.error.reserve"), *log_dir.glob("rank*.log"),
                 *log_dir.glob("rank*.heartbeat.json"), log_dir / "launcher.log"]:
        path.unlink(missing_ok=True)
