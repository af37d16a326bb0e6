"""Paths in what `dsmt generate` writes: every one in dsmt's scripts is a quoted shell word, and a run directory that
DeepSpeed's pdsh runner would hand bare to each node's shell is refused by name ([unsafe_path]) before anything is
written. Also job.sbatch's preemption signal. No launch: fake launchers print what they were given."""

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gen_helpers import REPO, SCRIPTS, VARIANTS, fake_launchers, spec_of
from toolkit.cli import main
from toolkit.errors import DsmtError, SpecError
from toolkit.generate.remote_shell import SAFE_CLASS
from toolkit.generate.writer import write_run_dir
from toolkit.check.job import check_job
from toolkit.spec.load import validate_spec

SHELLCHECK = shutil.which("shellcheck")
PDSH_SPEC = REPO / "configs" / "llama3-70b-8x8-h100.yaml"  # 8 nodes, cluster.launcher: pdsh
PWN = "$(touch PWNED)"
SAFE_NAME = "a-Z_0.9+b,c@d=e"  # every character SAFE_CLASS allows besides '/'


def _pdsh_remote_command(run_dir: Path, monkeypatch) -> str:
    """The line DeepSpeed's pdsh runner has each node's shell run for launch_deepspeed.sh's call from `run_dir`
    (pdsh's %n substituted), with the Python it starts replaced by `pwd`, PYTHONPATH and its arguments printed."""
    runner = pytest.importorskip("deepspeed.launcher.runner")
    from deepspeed.launcher.multinode_runner import PDSHRunner

    monkeypatch.chdir(run_dir)
    args = runner.parse_args(["--hostfile", "hostfile", "--launcher", "pdsh", "--no_local_rank", "--module",
                              "toolkit.train", "--config", f"{run_dir}/job.resolved.yaml", "--run-dir", str(run_dir)])
    pdsh = PDSHRunner(args, "WORLD_INFO")
    pdsh.add_export("PYTHONPATH", os.path.abspath("."))  # what runner.main exports: the working directory first
    words, _, _ = pdsh.get_cmd({}, {"node01": [0], "node02": [0]})
    command = " ".join(words[words.index("node01,node02") + 1:]).replace("%n", "0")
    return command.replace(runner.sys.executable, 'pwd; printf "%s\\n" "$PYTHONPATH"; printf "<%s>\\n"', 1)


def test_deepspeed_pdsh_runner_carries_the_safe_characters_and_runs_the_others(tmp_path, monkeypatch):
    """Why [unsafe_path] exists, and that its character set is what DeepSpeed's pdsh runner passes intact."""
    remote = tmp_path / "node"
    remote.mkdir()
    safe, hostile = tmp_path / SAFE_NAME, tmp_path / f"exp {PWN}"
    for run_dir in (safe, hostile):
        run_dir.mkdir()
    literal_characters = SAFE_CLASS.replace("a-z", "").replace("A-Z", "").replace("0-9", "").replace("/", "")
    assert set(literal_characters) <= set(SAFE_NAME)
    out = subprocess.run(["bash", "-c", _pdsh_remote_command(safe, monkeypatch)], cwd=remote, capture_output=True,
                         text=True)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[:2] == [str(safe), str(safe)], out.stdout + out.stderr
    assert f"<{safe}/job.resolved.yaml>" in lines and f"<{safe}>" in lines
    subprocess.run(["bash", "-c", _pdsh_remote_command(hostile, monkeypatch)], cwd=remote, capture_output=True)
    assert (remote / "PWNED").exists()  # the node's shell ran the path's $(...)


@pytest.mark.parametrize("name, characters", [
    (f"exp {PWN}", "' ', '$', '(', ')'"), ("with space", "' '"), ("it's", '"\'"'), ("50%n", "'%'"),
])
def test_generate_refuses_a_run_dir_pdsh_would_hand_to_a_shell(name, characters, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", str(PDSH_SPEC), "--out", f"runs/{name}"]) == 2
    first_line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("dsmt generate:"))
    assert first_line.startswith(f"dsmt generate: error: [unsafe_path] run directory {str(tmp_path / 'runs' / name)!r} "
                                 f"contains {characters}, which DeepSpeed's pdsh runner (cluster.launcher: pdsh, 8 "
                                 "nodes) passes unquoted to each node's shell"), first_line
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing run


def test_generate_checks_the_run_dir_as_the_kernel_resolves_it(tmp_path):
    """DeepSpeed sends os.path.abspath('.'), symlinks resolved: a link does not hide the blank behind it."""
    (tmp_path / "shared disk").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "shared disk")
    with pytest.raises(DsmtError, match=r"^\[unsafe_path\] run directory '.*/link/run' \(resolved: '.*/shared disk/run'\)"):
        write_run_dir(job=check_job(spec_of("llama3-70b-8x8-h100")), out_dir=tmp_path / "link" / "run")
    assert list((tmp_path / "shared disk").iterdir()) == []


def test_launch_deepspeed_refuses_a_run_dir_moved_to_an_unsafe_path(tmp_path):
    write_run_dir(job=check_job(spec_of("llama3-70b-8x8-h100")), out_dir=tmp_path / "run")
    moved = tmp_path / f"moved {PWN}"
    (tmp_path / "run").rename(moved)
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(moved / "launch_deepspeed.sh")], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr  # deepspeed never started
    assert f"launch_deepspeed.sh: [unsafe_path] the run directory {moved} holds a character" in out.stderr
    assert not (tmp_path / "PWNED").exists()


HOSTILE = "it's a \"run\" $(touch PWNED) `touch PWNED` \\ end"


@pytest.mark.parametrize("name, node_rank", [("tiny-cpu", []), ("no-ssh-2x8-tcp", ["1"])])
def test_other_launches_take_any_path_quoted(name, node_rank, tmp_path):
    """One machine and no_ssh: no remote shell, so blanks and quotes are fine, in the run directory and in the spec's
    paths (those stay in job.resolved.yaml: no script names them). bash -n, shellcheck, and the words each script
    hands its launcher."""
    output_dir = str(tmp_path / f"out {HOSTILE}")
    raw = {**VARIANTS[name], "training": {**VARIANTS[name]["training"], "output_dir": output_dir}}
    run = tmp_path / f"run {HOSTILE}"
    write_run_dir(job=check_job(validate_spec(raw, source=name)), out_dir=run)
    scripts = [str(run / script) for script in SCRIPTS]
    for script in scripts:
        assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0, script
        # the spec's paths stay in job.resolved.yaml; job.sbatch names only rank 0's heartbeat, one quoted word
        heartbeat_line = f"HEARTBEAT={shlex.quote(output_dir + '/logs/rank0.heartbeat.json')}\n"
        text = Path(script).read_text()
        assert (heartbeat_line in text) == script.endswith("job.sbatch")
        assert output_dir not in text.replace(heartbeat_line, "")
    if SHELLCHECK is not None:
        result = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", *scripts], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
    assert yaml.safe_load((run / "job.resolved.yaml").read_text())["training"]["output_dir"] == output_dir
    fake_launchers(tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    for script, args in (("launch_deepspeed.sh", node_rank), ("launch_torchrun.sh", [])):
        out = subprocess.run(["bash", str(run / script), *args], capture_output=True, text=True, env=env, cwd=tmp_path)
        lines = out.stdout.splitlines()
        assert out.returncode == 0, out.stderr
        assert lines[lines.index("--config") + 1] == f"{run}/job.resolved.yaml" and lines[lines.index("--run-dir") + 1] == str(run)
    assert not list(tmp_path.rglob("PWNED"))


def test_sbatch_asks_for_sigterm_preemption_grace_s_before_the_time_limit(tmp_path):
    """--signal=TERM@N without B: (SLURM signals the steps' processes, torchrun and the ranks, not the batch shell or
    srun, which would turn SIGTERM into SIGKILL), in the directive block sbatch reads, and torchrun's shutdown
    timeout as long (else it SIGKILLs the ranks 30 s after the signal); srun stays in the foreground."""
    raw = {**VARIANTS["slurm-pp2-site"]}
    raw["training"] = {**raw["training"], "preemption_grace_s": 300}
    write_run_dir(job=check_job(validate_spec(raw, source="x")), out_dir=tmp_path / "run")
    lines = (tmp_path / "run" / "job.sbatch").read_text().splitlines()
    directives = lines[1:lines.index("set -euo pipefail")]
    assert all(line.startswith("#") for line in directives)  # sbatch stops reading #SBATCH at the first command
    assert [line for line in directives if "--signal" in line] == ["#SBATCH --signal=TERM@300"]
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in lines[:srun]
    assert not lines[-1].endswith("&") and "wait" not in lines[srun:]


def test_extra_sbatch_signal_is_refused_naming_the_field():
    raw = {**VARIANTS["slurm-pp2-site"]}
    raw["cluster"] = {**raw["cluster"], "slurm": {"extra_sbatch": ["--signal=B:USR1@60"]}}
    with pytest.raises(SpecError, match=r"sbatch_option.*set training\.preemption_grace_s"):
        validate_spec(raw, source="x")


@pytest.mark.parametrize("written_by_this_job, expected", [(True, 75), (False, 1)])
def test_sbatch_exits_75_when_the_ranks_stopped_on_sigterm_after_saving(tmp_path, written_by_this_job, expected):
    """torchrun exits 1 whatever its ranks returned: job.sbatch reads rank 0's heartbeat instead, and only one this
    job wrote (a heartbeat left by an earlier preempted run says nothing of this one)."""
    from toolkit.generate import scripts
    from toolkit.launch import heartbeat

    assert scripts.STOPPED_ON_SIGTERM == heartbeat.STOPPED_ON_SIGTERM
    assert scripts.RANK0_HEARTBEAT == f"logs/{heartbeat.heartbeat_file(Path('.'), 0).name}"
    raw = {**VARIANTS["tiny-cpu"]}
    raw["training"] = {**raw["training"], "output_dir": str(tmp_path / "out dir")}
    write_run_dir(job=check_job(validate_spec(raw, source="x")), out_dir=tmp_path / "run")
    beat = tmp_path / "out dir" / "logs" / "rank0.heartbeat.json"
    beat.parent.mkdir(parents=True)
    phase = heartbeat.stopped_phase(saved=tmp_path / "out dir" / "checkpoints" / "step_000007")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: the job's ranks stopped on SIGTERM after saving (this job's heartbeat), and torchrun's exit 1
    touch = f"touch {'' if written_by_this_job else '-d 2000-01-01 '}\"{beat}\""
    (bin_dir / "srun").write_text(f"#!/usr/bin/env bash\necho '{{\"phase\": \"{phase}\"}}' > \"{beat}\"\n"
                                  f"{touch}\nexit 1\n")
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7"}
    done = subprocess.run(["bash", str(tmp_path / "run" / "job.sbatch")], env=env, capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == expected, done.stderr
    assert ("submit the job again to resume (exit 75)" in done.stderr) == written_by_this_job
