"""End to end on this machine: the generated launch scripts really start every rank (one node).

The probe run swaps `toolkit.train` for `launch_probe` (gloo all-reduce), so the launchers, rendezvous and
environment are checked in seconds. Real training through the generated scripts runs on two nodes (pdsh over a
local sshd, torchrun once per node) in tests/launch/test_two_nodes.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gen_helpers import VARIANTS
from toolkit.generate.writer import write_run_dir
from toolkit.check.job import check_job
from toolkit.launch.ports import free_port
from toolkit.spec.load import validate_spec

pytestmark = pytest.mark.multiproc
HERE = Path(__file__).parent
REPO = HERE.parents[1]


def _tiny_run_dir(tmp_path: Path, *, train_module: str, **training) -> Path:
    raw = {**VARIANTS["tiny-cpu"]}
    raw["cluster"] = {**raw["cluster"], "master_port": free_port()}
    raw["training"] = {**raw["training"], "output_dir": str(tmp_path / "out"), **training}
    run = tmp_path / "run"
    write_run_dir(job=check_job(validate_spec(raw, source="tiny-cpu")), out_dir=run, train_module=train_module)
    return run


def _launch(script: Path, *, probe_out: Path | None = None, timeout_s: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    if probe_out is not None:
        env["DSMT_PROBE_OUT"] = str(probe_out)
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=timeout_s)


@pytest.mark.parametrize("script", ["launch_torchrun.sh", "launch_deepspeed.sh"])
def test_generated_script_starts_every_rank(script, tmp_path):
    run = _tiny_run_dir(tmp_path, train_module="launch_probe")
    probe_out = tmp_path / "probe"
    probe_out.mkdir()
    result = _launch(run / script, probe_out=probe_out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = sorted((json.loads(p.read_text()) for p in probe_out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 == r["spec_ranks"] and r["all_reduce_sum"] == 3.0 for r in reports)
    assert [r["local_rank"] for r in reports] == [0, 1]
    assert all(r["env"] == {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"} for r in reports)
    assert all(r["run_dir_files"] == ["ds_config.json", "megatron.json"] for r in reports)
