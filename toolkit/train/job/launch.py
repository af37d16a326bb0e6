"""`dsmt train`'s launcher: a checked job's ranks on this machine, under the output directory's run lock."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.spec.checked import CheckedJob


def launch_training(*, job: CheckedJob, spec_file: Path | None = None, source: str | None = None) -> None:
    """Run the checked `job`'s ranks on this machine and wait (`dsmt train`, `toolkit.api.train`). The ranks read
    the job's spec from `spec_file` (None: OUTPUT_DIR/dsmt_job.yaml, written here under the run lock) and rebuild
    the job from it (`python -m toolkit.train`). `source` names the spec in messages (default: the spec file).
    The output directory's run lock is held from before the first rank starts until the last one ended; under
    it the spec is recorded as the directory's job, or refused as another job's continuation
    (`job.continue_with_changes`: --continue-with-changes; toolkit/train/job/run_identity.py)."""
    from toolkit import backend as backends
    from toolkit.generate.env import environment
    from toolkit.launch import run_lock
    from toolkit.launch.local import launch_local_workers
    from toolkit.spec.layout import world_size_of
    from toolkit.train.job.run import require_weights

    spec = job.spec
    output_dir = Path(spec.training.output_dir)
    source = source or str(spec_file or output_dir / RESOLVED_SPEC_FILE)
    require_weights(spec)
    backends.select(device=spec.cluster.device)  # CUDA asked for but absent: stop here, before any rank starts
    if spec.cluster.nodes > 1:
        raise DsmtError(f"cluster.nodes={spec.cluster.nodes}: `dsmt train` starts ranks on this machine only; "
                        f"run `dsmt generate {source} --out run/` and launch run/launch_deepspeed.sh or job.sbatch")
    with run_lock.acquire(output_dir=output_dir, command=f"dsmt train {source}").keep_renewed() as lock:
        if lock.took_over:
            print(lock.takeover_line(), flush=True)
            wait_for_gone_ranks(log_dir=output_dir / "logs")
        from toolkit.train.job import run_identity

        admitted = run_identity.admit(spec=spec, allow_changes=job.continue_with_changes)
        for line in run_identity.accepted_lines(admitted):
            print(line, flush=True)
        spec_file = spec_file if spec_file is not None else write_spec_file(job=job)
        write_data_digest(job=job)
        # The environment the generated scripts export (.deepspeed_env): NCCL presets and
        # CUDA_DEVICE_MAX_CONNECTIONS=1 on GPUs, DS_ACCELERATOR=cpu and one thread per rank on the CPU; the spec's
        # communication.extra_env last; the lock's path, so the ranks do not take it again.
        launch_local_workers(module="toolkit.train", args=rank_args(job=job, spec_file=spec_file),
                             nprocs=world_size_of(spec), log_dir=output_dir / "logs",
                             timeout_s=None,  # a training run takes as long as it takes
                             env={**environment(spec=spec), run_lock.LOCK_ENV: str(lock.path)},
                             stop_grace_s=spec.training.preemption_grace_s,
                             hang_timeout_s=spec.training.hang_timeout_s)


SPEC_FILE = "job.yaml"  # toolkit.api.train's default spec file for its ranks: OUTPUT_DIR/job.yaml
RESOLVED_SPEC_FILE = "dsmt_job.yaml"  # `dsmt train SPEC --set ...`: the spec with the overrides, for its ranks


def write_spec_file(*, job: CheckedJob) -> Path:
    """OUTPUT_DIR/dsmt_job.yaml: the job's validated spec with every path absolute (against this directory, as the
    launcher reads them: a relative output_dir would be taken against the file's own folder), for its ranks. A
    name of dsmt's own, so that no spec of the user's in the output directory is replaced."""
    from toolkit.spec.load import absolutize_paths, dump_spec

    path = Path(job.spec.training.output_dir).expanduser().absolute() / RESOLVED_SPEC_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_spec(absolutize_paths(job.spec, base_dir=Path.cwd())))
    return path


def write_data_digest(*, job: CheckedJob) -> None:
    """data_check.json where the ranks look for it (toolkit/check/job.py `verified_records`): the run directory,
    else the output directory. The pre-launch pass has just formatted every record; the ranks verify the files
    against this digest instead of formatting them again (toolkit/data/check_digest.py)."""
    from toolkit.data.check_digest import digest_directory, write_job_digest

    directory = digest_directory(run_dir=job.run_dir, output_dir=job.spec.training.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    write_job_digest(job=job, directory=directory)


def rank_args(*, job: CheckedJob, spec_file: Path) -> list[str]:
    """`python -m toolkit.train`'s arguments for the job's ranks."""
    run_dir = ["--run-dir", str(job.run_dir)] if job.run_dir is not None else []
    return ["--config", str(spec_file), *run_dir, *([] if job.resume_fallback else ["--no-fallback"])]


def wait_for_gone_ranks(*, log_dir: Path, timeout_s: float = 60.0) -> None:
    """After taking over a dead launcher's lock: its ranks may take a few seconds more to die (torchrun gives them
    30 s after SIGTERM); wait for them, and refuse rather than write beside one that lives on."""
    import time

    from toolkit.launch import heartbeat

    deadline = time.monotonic() + timeout_s
    while (alive := heartbeat.live_on_this_machine(log_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if alive:
        listed = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in alive)
        raise DsmtError(f"[one_run_per_output_dir] the previous run's launcher is gone but {listed} still run "
                        f"after {timeout_s:.0f} s; nothing was started\nfix: stop them (kill PID), then run the same "
                        "command again")
