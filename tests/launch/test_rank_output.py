"""dsmt's local launcher (toolkit/launch/local.py + toolkit/launch/rank_output.py) with real torchrun and 2 ranks: rank 0
speaks, rank 1 writes its file, a failure comes back once as a dsmt error with the rank's message and exit code,
without torchrun's traceback on the console."""

from pathlib import Path

import pytest

from toolkit.launch.local import launch_local_workers
from toolkit.launch.rank_output import RankFailure

pytestmark = [pytest.mark.multiproc, pytest.mark.cold_ranks]  # torchrun's path; test_warm_ranks.py: the warm one
PROBE_DIR = Path(__file__).resolve().parent


def _launch(tmp_path: Path, *how: str):
    launch_local_workers(module="rank_probe", args=list(how), nprocs=2, log_dir=tmp_path / "logs", timeout_s=120,
                         env={"PYTHONPATH": str(PROBE_DIR)})


def test_rank_zero_speaks_and_a_failure_is_said_once(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("DSMT_VERBOSE", raising=False)
    _launch(tmp_path, "1", "none")
    console = capfd.readouterr()
    assert "hello on stdout from rank 0" in console.out and "hello on stderr from rank 0" in console.err
    assert "rank 1" not in console.out + console.err
    rank1 = (tmp_path / "logs" / "rank1.log").read_text()
    assert "hello on stdout from rank 1" in rank1 and "hello on stderr from rank 1" in rank1

    with pytest.raises(RankFailure) as failure:
        _launch(tmp_path, "1", "dsmt")
    console = capfd.readouterr()
    message = str(failure.value)
    assert failure.value.exit_code == 2  # the rank's DsmtError code, not torchrun's 1
    assert message.startswith("rank 1 of 2 on ") and "the probe's spec is wrong on purpose" in message
    assert "Traceback" not in message + console.out + console.err  # neither the rank's nor torchrun's
    assert "ChildFailedError" in (tmp_path / "logs" / "launcher.log").read_text()  # kept, off the console
    assert "the probe's spec is wrong on purpose" in (tmp_path / "logs" / "rank1.log").read_text()


def test_a_bug_keeps_its_traceback_and_a_killed_rank_is_named(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("DSMT_VERBOSE", raising=False)
    with pytest.raises(RankFailure) as failure:
        _launch(tmp_path, "0", "bug")
    message = str(failure.value)
    assert failure.value.exit_code == 1
    assert message.startswith("rank 0 of 2") and "ValueError: an unexpected bug on purpose" in message
    assert "Traceback" in message and 'raise ValueError("an unexpected bug on purpose")' in message
    assert "Traceback" not in capfd.readouterr().err  # said once: in the error, not also by the ranks

    with pytest.raises(RankFailure) as failure:
        _launch(tmp_path, "1", "killed")
    message = str(failure.value)
    assert message.startswith("rank 1 of 2 failed first (killed by SIGKILL), without an error of its own"), message
    assert not list((tmp_path / "logs").glob("*.error.json"))  # the earlier launch's report was cleared


def test_verbose_keeps_every_rank_on_the_console(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("DSMT_VERBOSE", "1")
    _launch(tmp_path, "1", "none")
    console = capfd.readouterr()
    assert "hello on stdout from rank 0" in console.out and "hello on stdout from rank 1" in console.out
    assert not (tmp_path / "logs" / "rank1.log").exists()
