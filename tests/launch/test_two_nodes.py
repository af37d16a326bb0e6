"""Two nodes on one machine: the generated launch scripts train the tiny CPU spec on 2 nodes x 2 ranks.

`dsmt-node-a` (127.0.0.1) and `dsmt-node-b` (127.0.0.2) are names in /etc/hosts with one sshd listening on both
(sshd_nodes.py). launch_deepspeed.sh reaches both nodes through pdsh over that sshd; launch_torchrun.sh is run
once per node, as a user would, and the c10d rendezvous assigns the node ranks. "Both nodes trained" is read from
the launchers and from the trainer: pdsh prefixes every remote line with `host: `, DeepSpeed's per-node launcher
logs its node_rank, torchrun's agent its group_rank after the rendezvous, and each node's first rank prints
`dsmt train: node N of 2: ranks A..B` once its process group is up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch_helpers import REPO, require_programs
from sshd_nodes import NODES, TRAIN_STEPS, write_two_node_run

pytestmark = pytest.mark.multiproc


def _script_env(nodes) -> dict[str, str]:
    return {**nodes.env(), "PATH": f"{nodes.bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": str(REPO)}


def _assert_trained(out: Path, log: str) -> None:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, TRAIN_STEPS + 1)), log[-3000:]
    assert all(m["loss"] > 0 for m in metrics)
    assert (out / "checkpoints" / f"step_{TRAIN_STEPS:06d}" / "dsmt_complete.json").is_file()


def test_deepspeed_launcher_trains_on_two_nodes_over_pdsh(nodes, tmp_path):
    require_programs("pdsh")
    run = write_two_node_run(tmp_path)
    result = subprocess.run(["bash", str(run / "launch_deepspeed.sh")], capture_output=True, text=True,
                            env=_script_env(nodes), timeout=420)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    # deepspeed.launcher.launch logs "nnodes=2, num_local_procs=2, node_rank=N" on each node; pdsh prefixes the host
    for node_rank, host in enumerate(NODES):
        assert re.search(rf"^{host}: .*nnodes=2, num_local_procs=2, node_rank={node_rank}\b", log, re.M), log[-4000:]
        first = 2 * node_rank
        assert re.search(rf"^{host}: dsmt train: node {node_rank} of 2: ranks {first}\.\.{first + 1} on ", log, re.M), \
            log[-4000:]
    _assert_trained(tmp_path / "out", log)


def test_torchrun_script_per_node_trains_on_two_nodes(nodes, tmp_path):
    run = write_two_node_run(tmp_path)
    env = {**_script_env(nodes), "LOGLEVEL": "INFO"}
    procs = [subprocess.Popen(["bash", str(run / "launch_torchrun.sh")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for _ in NODES]
    try:
        logs = [proc.communicate(timeout=420)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], "\n----\n".join(log[-3000:] for log in logs)
    # each agent logs its node rank after the rendezvous: one got group_rank=0, the other group_rank=1
    group_ranks = sorted(int(m) for log in logs for m in re.findall(r"group_rank=(\d+)", log)[:1])
    assert group_ranks == [0, 1], "\n----\n".join(log[-3000:] for log in logs)
    trainer_nodes = sorted(int(m) for log in logs for m in re.findall(r"^dsmt train: node (\d) of 2: ", log, re.M))
    assert trainer_nodes == [0, 1], "\n----\n".join(log[-3000:] for log in logs)
    _assert_trained(tmp_path / "out", "\n".join(logs))
