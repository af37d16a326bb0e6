"""The generated launch_deepspeed.sh with cluster.launcher: openmpi under a real mpirun (Open MPI): DeepSpeed's
OpenMPI runner starts the 2 ranks of the tiny CPU spec on this machine (no ssh) and they train.

mpirun refuses to run as root unless told; the generated script never says so (a real cluster job should not run
as root by accident), so this test's environment does, and only when it runs as root."""

import os
import subprocess

import pytest

from launch_helpers import check_training_output, launch_env, require_programs, tiny_run_dir

TRAIN_STEPS = 2


@pytest.mark.multiproc
def test_openmpi_launcher_trains_two_ranks(tmp_path):
    require_programs("mpirun", "ompi_info")  # DeepSpeed's runner checks for ompi_info
    run = tiny_run_dir(tmp_path, train_steps=TRAIN_STEPS, cluster={"launcher": "openmpi"})
    as_root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    result = subprocess.run(["bash", str(run / "launch_deepspeed.sh")], cwd=tmp_path, env=launch_env(**as_root),
                            capture_output=True, text=True, timeout=480)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    command = next(line for line in output.splitlines() if "cmd = " in line)
    assert "cmd = mpirun -n 2 -hostfile" in command and "btl_tcp_if_include lo" in command, command
    assert "-x MASTER_ADDR -x MASTER_PORT" in command and "deepspeed.launcher.launch" not in command, command
    check_training_output(tmp_path / "out", train_steps=TRAIN_STEPS)
    # Both data-parallel ranks wrote their ZeRO-1 share of the state: two processes trained, as ranks 0 and 1.
    shards = sorted(p.name for p in (tmp_path / "out" / "checkpoints").rglob("rank_*.safetensors"))
    assert shards == ["rank_00000.safetensors", "rank_00001.safetensors"], shards


def test_mpi_ranks_become_torch_ranks():
    """What toolkit.parallel.groups.init_process_groups does first: OMPI_COMM_WORLD_* -> RANK / WORLD_SIZE / LOCAL_RANK,
    unless a launcher already set RANK."""
    from toolkit.parallel.groups import adopt_mpi_ranks

    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    env = dict(ompi)
    adopt_mpi_ranks(environ=env)
    assert env == {**ompi, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    torchrun = {**ompi, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    adopt_mpi_ranks(environ=torchrun)
    assert torchrun["RANK"] == "0" and torchrun["LOCAL_RANK"] == "0"
    plain = {"PATH": "/usr/bin"}
    adopt_mpi_ranks(environ=plain)
    assert plain == {"PATH": "/usr/bin"}
