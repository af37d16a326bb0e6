"""A model larger than the memory allowed converts: 1.1 GiB of bf16 tensors (a Llama shape of 8 layers, vocabulary
and width of a 1.1 B-parameter model) both ways under a 0.8 GiB resident-memory cap, bit-exact.

The conversions run as fresh processes; a watchdog polls each one's VmRSS every 20 ms and kills it the moment it
passes the cap, and the child reports its kernel high-water mark (VmHWM) at exit, which the test asserts is under
the cap too (a spike between two polls still shows there). The cap covers everything in the process, the
~0.4 GiB of torch / megatron-core / transformers imports included. Measured here on the 16-layer, 2 GiB model:
peak 0.54 GiB (hf-to-mcore) and 0.44 GiB (mcore-to-hf), set by the largest tensor (the 125 MiB embedding) and the
imports, not by the number of layers; the in-memory conversion this replaced peaked at 2.8 GiB above the imports.
8 layers keep the point (the model does not fit the cap) at half the suite's time."""

import pytest
import torch
from safetensors import safe_open

from toolkit.adapters.hf_source import SafetensorsSource
from benchmarks.convert_measure import run_dsmt, run_python, write_random_checkpoint

pytestmark = pytest.mark.multiproc

RSS_CAP_BYTES = int(0.8 * 2**30)


def assert_same_tensors(original_dir, exported_dir):
    original, exported = SafetensorsSource(original_dir), SafetensorsSource(exported_dir)
    assert original.names() == exported.names()
    for name in original.names():  # one tensor at a time: this process stays small too
        with safe_open(str(original.file_of(name)), "pt") as a, safe_open(str(exported.file_of(name)), "pt") as b:
            left, right = a.get_tensor(name), b.get_tensor(name)
            assert left.dtype == right.dtype == torch.bfloat16 and torch.equal(left, right), name


def test_a_model_larger_than_the_cap_converts_both_ways_under_it(tmp_path):
    total_bytes, largest_bytes = write_random_checkpoint(tmp_path / "hf", num_layers=8)
    assert total_bytes > 2**30 > RSS_CAP_BYTES and largest_bytes == 125 * 2**20  # the model does not fit the cap
    steps = [["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mcore"), "--quiet"],
             ["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back"), "--quiet"]]
    for argv in steps:
        run = run_dsmt(argv, rss_cap_bytes=RSS_CAP_BYTES)
        print(f"dsmt {' '.join(argv[:2])}: {run.seconds:.1f} s, peak RSS {run.peak_rss_bytes / 2**30:.2f} GiB")
        assert run.killed_at_bytes is None, f"killed at {run.killed_at_bytes / 2**30:.2f} GiB RSS:\n{run.output}"
        assert run.returncode == 0, run.output
        assert 0 < run.peak_rss_bytes < RSS_CAP_BYTES, run.output
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")


def test_the_watchdog_stops_a_process_over_the_cap():
    """The cap is real: a process that holds more than it allows (1.5 GiB here) is killed, not waited for."""
    code = "import torch, time; x = torch.ones(3 * 2**29, dtype=torch.uint8); time.sleep(30)"
    run = run_python(code, [], rss_cap_bytes=RSS_CAP_BYTES)
    assert run.killed_at_bytes is not None and run.killed_at_bytes > RSS_CAP_BYTES and run.seconds < 25
