"""Every script in benchmarks/ must keep running (train_step.py went unrun for several changes and failed on a
changed launch API): each in its smoke mode, with what it prints checked and no timing asserted (plan_speed.py's
one-second budget is off under --smoke)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 600) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.multiproc
def test_train_step_benchmark_prints_its_ratio():
    output = run("-m", "benchmarks.train_step", "--layout", "tp2-dp2", "--steps", "1")
    assert re.search(r"ratio dsmt/hand = \d+\.\d+", output), output


def test_plan_speed_benchmark_finds_a_layout():
    output = run("benchmarks/plan_speed.py", "--smoke")
    assert re.search(r"evaluated \d+ layouts \(\d+ fit\)", output) and "best: " in output, output


def test_convert_speed_benchmark_converts_both_ways():
    output = run("benchmarks/convert_speed.py", "--smoke")
    for step in ("hf-to-mcore --workers 1", "mcore-to-hf --workers 1"):
        assert re.search(rf"^{step}\s+[\d.]+\s+[\d.]+", output, re.MULTILINE), output


@pytest.mark.multiproc
def test_plan_vs_live_benchmark_compares_one_launch():
    output = run("benchmarks/plan_vs_live.py", "--smoke")
    assert "launch 0: 2 processes" in output and "launch 1" not in output, output
    assert "largest |deviation| over every rank: parameters" in output, output


def test_data_prepare_benchmark_prints_its_ratios():
    output = run("benchmarks/data_prepare.py", "--smoke")
    for name in ("tiny-char", "bpe-512"):
        assert f"\n{name}:\n" in output, output
    assert len(re.findall(r"^  ratio prepare/tokenizer = \d+\.\d+  \(--workers [12]\)$", output, re.MULTILINE)) == 4
    assert output.count("outputs byte-identical across --workers: yes") == 2, output


def test_manifest_cost_benchmark_prints_its_ratios():
    output = run("benchmarks/manifest_cost.py", "--smoke")
    assert re.search(r"^manifest, page cache \(after save\)\s.*ratio manifest/save = \d+\.\d+$", output,
                     re.MULTILINE), output
    assert re.search(r"xxh3_128 \d+ MB/s, zlib\.crc32 \d+ MB/s", output), output


@pytest.mark.multiproc
def test_checkpoint_cost_benchmark_measures_save_and_resume():
    output = run("benchmarks/checkpoint_cost.py", "--smoke")
    for call in ("save step 1", "save step 2", "resume step 2", "save step 3"):
        assert re.search(rf"^  smoke\s+2\s+[\d.]+\s+{call}(\s+-?[\d.]+){{8}}", output,
                         re.MULTILINE), output
