"""The test session's warm rank servers (tests/harness/warm_ranks.py) against what torchrun gives a rank: fresh state
per launch, the rank's own hash seed, the caller's environment and output, a failure named, a timeout stopped,
and a launch that a fork cannot serve exactly (an import-time variable changed) started cold."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.warm_ranks import RUNNER, SERVERS_ENV
from toolkit.launch.local import RANK_RUNNER_ENV, launch_local_workers, run_ranks
from toolkit.launch.rank_output import RankFailure

pytestmark = pytest.mark.multiproc
HERE = Path(__file__).resolve().parent
PROBE = HERE / "warm_probe.py"


@pytest.fixture
def servers(tmp_path_factory, monkeypatch):
    """The session's servers, or two of this test's own when the session runs cold (DSMT_COLD_RANKS=1)."""
    if os.environ.get(SERVERS_ENV):
        yield Path(os.environ[SERVERS_ENV])
        return
    directory = tmp_path_factory.mktemp("warm")
    started = [subprocess.Popen([sys.executable, "-m", "tests.harness.warm_ranks", "--dir", str(directory),
                                 "--local-rank", str(k)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                cwd=HERE.parents[1], stderr=subprocess.DEVNULL) for k in range(2)]
    monkeypatch.setenv(SERVERS_ENV, str(directory))
    monkeypatch.setenv(RANK_RUNNER_ENV, RUNNER)
    yield directory
    for server in started:
        server.terminate()
        server.wait()


def launched(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "launches.jsonl").read_text().splitlines()]


def probe(tmp_path: Path, *args: str, env: dict | None = None, timeout_s: float = 120) -> tuple[int, list[dict]]:
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout, open(tmp_path / "err.txt", "w") as stderr:
        returncode = run_ranks([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                f"--master_port={__import__('toolkit.launch.ports').launch.ports.free_port()}", str(PROBE),
                                *args], target=["path", str(PROBE)], args=list(args), nprocs=2,
                               env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=stdout,
                               stderr=stderr, timeout_s=timeout_s, cwd=str(tmp_path))
    return returncode, sorted((json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")),
                              key=lambda rank: rank["rank"])


def test_each_launch_is_a_fresh_process_with_its_own_streams(servers, tmp_path):
    _, first = probe(tmp_path, "a", env={"WARM_PROBE_MARKER": "given"})
    _, second = probe(tmp_path, "b")
    assert launched(servers)[-2:] == [{"target": str(PROBE), "nprocs": 2, "warm": True, "why": None}] * 2
    for ranks, argv in ((first, ["a"]), (second, ["b"])):
        assert [rank["sum"] for rank in ranks] == [3.0, 3.0]  # one group of 2 ranks
        assert all(rank["fresh_parallel_state"] and rank["threads"] == 1 for rank in ranks)
        assert all(rank["argv"] == argv and rank["path0"] == str(HERE) and rank["cwd"] == str(tmp_path)
                   for rank in ranks)
        assert ranks[0]["hash"] != ranks[1]["hash"]  # each rank its own string-hash seed, as under torchrun
    assert [rank["marker"] for rank in first] == ["given"] * 2 and [rank["marker"] for rank in second] == [None] * 2
    draws = [rank[key] for rank in first + second for key in ("random", "fingerprint", "torch_seed")]
    assert len(set(draws)) == len(draws)  # no stream repeats between ranks or launches


def test_an_import_time_variable_sends_the_launch_cold(servers, tmp_path):
    returncode, ranks = probe(tmp_path, "c", env={"HF_DATASETS_CACHE": str(tmp_path / "cache")})
    assert returncode == 0 and [rank["argv"] for rank in ranks] == [["c"], ["c"]]
    assert launched(servers)[-1] == {"target": str(PROBE), "nprocs": 2, "warm": False,
                                     "why": "import-time environment differs: HF_DATASETS_CACHE"}


def test_failures_are_reported_as_under_torchrun(servers, tmp_path, capfd, monkeypatch):
    """tests/launch/test_rank_output.py's checks, on warm ranks (its torchrun-only line excepted)."""
    monkeypatch.delenv("DSMT_VERBOSE", raising=False)
    logs = tmp_path / "logs"

    def launch(*how):
        launch_local_workers(module="rank_probe", args=list(how), nprocs=2, log_dir=logs, timeout_s=120,
                             env={"PYTHONPATH": str(HERE)})

    launch("1", "none")
    console = capfd.readouterr()
    assert "hello on stdout from rank 0" in console.out and "rank 1" not in console.out + console.err
    assert "hello on stderr from rank 1" in (logs / "rank1.log").read_text()
    with pytest.raises(RankFailure) as failure:
        launch("1", "dsmt")
    assert failure.value.exit_code == 2 and str(failure.value).startswith("rank 1 of 2 on ")
    with pytest.raises(RankFailure) as failure:
        launch("0", "bug")
    assert 'raise ValueError("an unexpected bug on purpose")' in str(failure.value)
    assert "Traceback" not in capfd.readouterr().err
    with pytest.raises(RankFailure) as failure:
        launch("1", "killed")
    assert str(failure.value).startswith("rank 1 of 2 failed first (killed by SIGKILL), without an error of its own")
    assert all(launch["warm"] for launch in launched(servers)[-4:])


def test_a_timeout_stops_every_rank(servers, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        probe(tmp_path, "sleep", timeout_s=8)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 30  # the managers stop and reap their ranks once the caller has hung up
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_which_import_time_values_a_fork_can_serve():
    from tests.harness.warm_ranks import same_at_import

    assert same_at_import("HF_HOME", server="/a", launch="/a")
    assert not same_at_import("HF_HOME", server="/a", launch="/b")
    assert not same_at_import("HF_HOME", server=None, launch="/b")
    # servers run only where torch sees no GPU: hiding GPUs, or naming some under a server that saw none, is the same
    assert same_at_import("CUDA_VISIBLE_DEVICES", server=None, launch="")
    assert same_at_import("CUDA_VISIBLE_DEVICES", server=None, launch="0")
    assert same_at_import("CUDA_VISIBLE_DEVICES", server="0", launch="")
    assert not same_at_import("CUDA_VISIBLE_DEVICES", server="", launch="0")


def test_a_server_that_stopped_sends_the_launch_cold(tmp_path, monkeypatch):
    """Ready files without a listening socket: a server that died after starting. Nothing starts warm."""
    directory = tmp_path / "servers"
    directory.mkdir()
    for rank in range(2):
        (directory / f"rank{rank}.json").write_text(json.dumps({"pid": 0, "prefixes": [], "env": {},
                                                                "accelerator": "cpu"}))
    monkeypatch.setenv(SERVERS_ENV, str(directory))
    monkeypatch.setenv(RANK_RUNNER_ENV, RUNNER)
    returncode, ranks = probe(tmp_path, "d")
    assert returncode == 0 and [rank["argv"] for rank in ranks] == [["d"], ["d"]]
    last = launched(directory)[-1]
    assert not last["warm"] and last["why"].startswith("rank server 0 in ") and "does not answer" in last["why"]
