"""The generated job.sbatch under a real SLURM (slurmctld + slurmd on 127.0.0.1, tests/launch/slurm_cluster.py):
`sbatch --wait` trains the tiny CPU spec (1 node x 2 ranks, srun -> torchrun) with cluster.slurm extras whose
values sbatch must keep whole (blanks, '#')."""

import subprocess

import pytest

from launch_helpers import check_training_output, launch_env, tiny_run_dir
from slurm_cluster import slurm_cluster

pytestmark = pytest.mark.multiproc
TRAIN_STEPS = 2


def test_sbatch_trains_the_tiny_cpu_spec(tmp_path):
    with slurm_cluster(tmp_path / "slurm") as cluster:
        job_log = tmp_path / "slurm logs" / "job %j.log"  # a blank in a directive value: quoted in job.sbatch
        job_log.parent.mkdir()
        slurm = {"partition": cluster.partition, "account": "dsmt test", "time": "15:00",
                 "extra_sbatch": [f"--output={job_log}", "--comment=dsmt #real-slurm test"],
                 "setup": ["export DSMT_SLURM_SETUP_RAN=1",
                           'echo "setup ran: DSMT_SLURM_SETUP_RAN=$DSMT_SLURM_SETUP_RAN partition=$SLURM_JOB_PARTITION"'],
                 "srun_args": ["--label"]}  # srun prefixes every output line with the task id
        run = tiny_run_dir(tmp_path, train_steps=TRAIN_STEPS, cluster={"slurm": slurm})
        result = subprocess.run(["sbatch", "--parsable", "--wait", str(run / "job.sbatch")], cwd=tmp_path,
                                env=launch_env(**cluster.env), capture_output=True, text=True, timeout=480)
        job_id = result.stdout.strip().split(";")[0]
        logs = [p.read_text(errors="replace") for p in job_log.parent.glob("*.log")]
        assert result.returncode == 0, f"{result.stdout}{result.stderr}\n" + "\n".join(log[-4000:] for log in logs)
        job = cluster.client("scontrol", "show", "job", job_id).stdout
    assert [p.name for p in job_log.parent.iterdir()] == [f"job {job_id}.log"]
    assert "setup ran: DSMT_SLURM_SETUP_RAN=1 partition=dsmt-test" in logs[0]
    assert any(line.startswith("0: ") for line in logs[0].splitlines()), logs[0][-3000:]
    for field in ("Account=dsmt test", "TimeLimit=00:15:00", "Comment=dsmt #real-slurm test", "Partition=dsmt-test",
                  "JobState=COMPLETED"):
        assert field in job, job
    check_training_output(tmp_path / "out", train_steps=TRAIN_STEPS)
