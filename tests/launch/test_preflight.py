"""`dsmt preflight RUN_DIR` against real launchers: two sshd "nodes" (pdsh, mpirun) and the failures it must name.

One sshd serves the whole module. A version mismatch is made honestly: --python points at a wrapper that, on
dsmt-node-b only (ssh arrived on 127.0.0.2), puts a directory holding another deepspeed's dist-info first on
sys.path, so the probe there finds DeepSpeed 0.0.1 metadata as a node with another install would.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch_helpers import require_programs, write_run
from sshd_nodes import NODES, UNREACHABLE, two_node_spec, write_two_node_run
from toolkit.check.preflight import compare_nodes

pytestmark = pytest.mark.multiproc  # launches probes on two "nodes" through pdsh / mpirun / srun


def preflight(run: Path, *, env: dict[str, str], extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "preflight", str(run), "--timeout", "30", *extra],
                            capture_output=True, text=True, env=env, timeout=120)
    print(result.stdout, result.stderr)
    return result


def test_two_nodes_over_pdsh_all_pass(nodes, tmp_path):
    require_programs("pdsh")
    result = preflight(write_two_node_run(tmp_path), env=nodes.env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK (0 errors" in result.stdout
    assert "dsmt-node-a, dsmt-node-b: reached through pdsh" in result.stdout
    assert "[preflight_nodes_match] 2 node(s): versions dsmt" in result.stdout
    assert "device=cpu: the GPU count is not applicable" in result.stdout
    assert "is free on dsmt-node-a" in result.stdout


def test_unreachable_host_is_named(nodes, tmp_path):
    require_programs("pdsh")
    run = write_two_node_run(tmp_path, hosts=(*NODES, UNREACHABLE[0]))
    result = preflight(run, env=nodes.env())
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if "[preflight_unreachable]" in line]
    assert f"{UNREACHABLE[0]}: not reachable through pdsh" in line and "dsmt-node-a:" not in line
    assert "dsmt-node-a, dsmt-node-b: reached through pdsh" in result.stdout


def _fake_deepspeed_python(tmp_path: Path, *, on_address: str) -> Path:
    fake_site = tmp_path / "other-site"
    (fake_site / "deepspeed-0.0.1.dist-info").mkdir(parents=True)
    (fake_site / "deepspeed-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\n"
                                                                      "Version: 0.0.1\n")
    wrapper = tmp_path / "bin" / "python"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase "$SSH_CONNECTION" in *" {on_address} "*) '
                       f'export PYTHONPATH="{fake_site}${{PYTHONPATH:+:$PYTHONPATH}}";; esac\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_version_mismatch_on_one_node_is_named(nodes, tmp_path):
    require_programs("pdsh")
    python = _fake_deepspeed_python(tmp_path, on_address=NODES["dsmt-node-b"])
    result = preflight(write_two_node_run(tmp_path), env=nodes.env(), extra=("--python", str(python)))
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if "[preflight_versions]" in line]
    here = importlib.metadata.version("deepspeed")
    assert f"dsmt-node-b ({sys.executable}): deepspeed {here} here but 0.0.1 on dsmt-node-b" in line


def test_missing_python_on_the_nodes_is_named(nodes, tmp_path):
    require_programs("pdsh")
    result = preflight(write_two_node_run(tmp_path), env=nodes.env(), extra=("--python", "/nonexistent/bin/python"))
    assert result.returncode == 2
    named = [line for line in result.stdout.splitlines() if "[preflight_python_missing]" in line]
    assert sorted(line.split("]")[1].split(":")[0].strip() for line in named) == sorted(NODES)
    assert all("python /nonexistent/bin/python does not exist" in line for line in named)


def test_busy_master_port_is_named(nodes, tmp_path):
    require_programs("pdsh")
    run = write_two_node_run(tmp_path)
    port = int(next(line.split()[1] for line in (run / "launch_torchrun.sh").read_text().splitlines()
                    if line.strip().startswith("--rdzv_endpoint")).split(":")[-1].rstrip('"'))
    with socket.socket() as busy:
        busy.bind((NODES["dsmt-node-a"], port))
        busy.listen()
        result = preflight(run, env=nodes.env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"[preflight_master_port] master_port={port} is in use on the master host dsmt-node-a" in result.stdout


def test_missing_launcher_binary_is_named(tmp_path):
    run = write_two_node_run(tmp_path)
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no /usr/bin: no pdsh
    result = preflight(run, env=env)
    assert result.returncode == 2
    assert "[preflight_launcher_missing] pdsh (cluster.launcher=pdsh" in result.stdout
    assert "install pdsh on this node" in result.stdout


def test_slurm_hosts_outside_an_allocation_is_named(tmp_path):
    raw = two_node_spec(output_dir=tmp_path / "out")
    raw["cluster"]["hosts"] = "slurm"
    run = write_run(raw, tmp_path / "run", source="slurm-hosts")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = preflight(run, env=env)
    assert result.returncode == 2
    assert "[preflight_slurm_allocation] cluster.hosts is 'slurm' but SLURM_JOB_NODELIST is unset" in result.stdout


def test_no_ssh_checks_this_node_and_says_the_others_are_not(tmp_path):
    result = preflight(write_two_node_run(tmp_path, launcher="no_ssh"), env=dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "only this node is checked; ['dsmt-node-b'] are not" in result.stdout


def test_two_nodes_over_mpirun_all_pass(nodes, tmp_path):
    require_programs("mpirun")
    env = {**nodes.env(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"}
    result = preflight(write_two_node_run(tmp_path, launcher="openmpi"), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dsmt-node-a, dsmt-node-b: reached through mpirun" in result.stdout


def test_slurm_hosts_inside_an_allocation_probe_through_srun(tmp_path):
    from slurm_cluster import slurm_cluster  # another suite's fixture (tests/launch/slurm_cluster.py)

    raw = two_node_spec(output_dir=tmp_path / "out", hosts=("unused",))
    raw["cluster"]["hosts"] = "slurm"
    run = write_run(raw, tmp_path / "run", source="slurm-hosts")
    with slurm_cluster(tmp_path / "slurm") as cluster:
        command = [sys.executable, "-m", "toolkit.cli", "preflight", str(run), "--timeout", "30"]
        result = cluster.client("salloc", "-N", "1", "--immediate=20", *command, timeout_s=90)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{cluster.node_name}: reached through srun" in result.stdout
    assert f"is free on {cluster.node_name}" in result.stdout


def test_deepspeed_bare_ssh_check_failing_is_named(nodes, tmp_path):
    require_programs("pdsh")
    env = nodes.env()
    env["PATH"] = env["PATH"].replace(f"{nodes.bin_dir}{os.pathsep}", "")  # plain ssh: no -F, so port 22
    result = preflight(write_two_node_run(tmp_path), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[preflight_deepspeed_ssh] dsmt-node-a: `ssh dsmt-node-a hostname` failed" in result.stdout
    assert "dsmt-node-a, dsmt-node-b: reached through pdsh" in result.stdout  # PDSH_SSH_ARGS_APPEND still works


def _node(**changes) -> dict:
    versions = {"dsmt": "0.1.0", "torch": "2.13.0", "deepspeed": "0.19.8", "megatron-core": "0.16.1"}
    return {"python": "/venv/bin/python", "versions": versions, "run_dir_readable": True, "env_file_sha256": "abc",
            "env": {}, "interfaces": ["eth0", "ib0", "lo"], "ib_devices": ["mlx5_0"], "gpu_count": 8,
            "port_free": True, **changes}


def test_node_comparison_names_gpus_interfaces_hcas_and_env_file():
    """The head-side verdicts on probe facts (GPU nodes are not available to this suite: pure facts here)."""
    env = {"NCCL_SOCKET_IFNAME": "bond0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0:1,mlx5_3"}
    answers = {"gpu-a": _node(), "gpu-b": _node(gpu_count=4, env=env, env_file_sha256="def")}
    found = {(p.rule, p.message.split(":")[0]) for p in compare_nodes(head=_node(), answers=answers, device="cuda",
                                                                      slots=8) if p.severity == "error"}
    assert found == {("preflight_gpu_count", "gpu-b"), ("preflight_env_file", "gpu-b"),
                     ("preflight_interface", "gpu-b"), ("preflight_ib_hca", "gpu-b")}
    ok_env = {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "=mlx5_0"}
    problems = compare_nodes(head=_node(), answers={"gpu-a": _node(env=ok_env)}, device="cuda", slots=8)
    assert [p.rule for p in problems] == ["preflight_nodes_match"]
