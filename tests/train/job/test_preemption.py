"""SIGTERM during training (toolkit/train/job/preemption.py): the flag, and the ranks' agreement on the step to
stop after. The whole run (SIGTERM to `dsmt train`, exit 75, exact resume): tests/train/checkpoint/test_faults.py."""

import os
import signal
import time
from pathlib import Path

import pytest

from ranks import run_on_ranks
from toolkit.train.job import preemption

PROBE = Path(__file__).resolve().parents[1] / "preemption_probe.py"  # tests/train


@pytest.fixture
def fresh_flag():
    preemption._requested.clear()
    yield
    preemption._requested.clear()
    preemption._training.clear()


def test_sigterm_raises_the_flag_and_the_handler_is_put_back(fresh_flag):
    before = signal.getsignal(signal.SIGTERM)
    with preemption.stop_on_sigterm():
        preemption.training_started()
        assert not preemption.agreed_stop()  # no process group: this process alone decides
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on
        deadline = time.monotonic() + 10
        while not preemption.requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert preemption.agreed_stop()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.multiproc
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step():
    result = run_on_ranks(PROBE, nprocs=2, timeout=120)
    output = result.stdout + result.stderr
    assert "rank 0: requested=False agreed=[False, True]" in output, output[-3000:]
    assert "rank 1: requested=True agreed=[False, True]" in output, output[-3000:]


def test_before_training_starts_sigterm_ends_the_rank_at_once():
    """A peer that failed early (rank 0 refusing the output directory) leaves the others blocked in
    init_process_group, where no step boundary comes: torchrun's SIGTERM must end them as it always did."""
    import subprocess
    import sys

    code = ("import os, signal, time\nfrom toolkit.train.job import preemption\n"
            "with preemption.stop_on_sigterm():\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 128 + signal.SIGTERM
