"""A one-node SLURM cluster on 127.0.0.1 for tests: slurmctld + slurmd from Debian's slurm-wlm (22.05), started
from a slurm.conf written under `root`, stopped on exit (also when the test fails).

    with slurm_cluster(tmp_path / "slurm") as cluster:
        subprocess.run(["sbatch", "--wait", "job.sbatch"], env={**os.environ, **cluster.env}, ...)

Recipe and pitfalls: docs/launcher-recipes.md section 1. auth/none (no munge), no cgroups, daemons bound to
127.0.0.1 only (NoInAddrAny), ports picked free, a fresh state directory per cluster. slurmd must run as root to
start jobs. Missing binaries or not root: the test skips, or fails when DSMT_REQUIRE_LAUNCHERS=1.
"""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from launch_helpers import require_programs, stop_process
from toolkit.launch.ports import free_port

NODE_NAME = "dsmt-slurm"  # need not resolve: slurmd -N names itself, NodeAddr says where it listens
PARTITION = "dsmt-test"
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SlurmCluster:
    root: Path
    conf: Path
    node_name: str
    partition: str
    env: dict[str, str]  # add to a client's environment (sbatch, srun, sinfo, scontrol): SLURM_CONF

    def client(self, *args: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster (always under a timeout: a client of a dead controller
        waits MessageTimeout per retry)."""
        return subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=timeout_s)


def _slurm_conf(*, root: Path, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    return "\n".join([
        "ClusterName=dsmt", "SlurmctldHost=localhost(127.0.0.1)",  # 'localhost' stands for this host's name
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}",
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",  # listen on 127.0.0.1, not 0.0.0.0
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/none", "CredType=cred/none", "MailProg=/bin/true",
        "MpiDefault=none", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "SwitchType=switch/none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "ReturnToService=2",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd.log",
        "SlurmctldDebug=info", "SlurmdDebug=info",
        f"NodeName={NODE_NAME} NodeHostname={NODE_NAME} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={NODE_NAME} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


@contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start slurmctld and slurmd (one node, os.cpu_count() CPUs, partition `dsmt-test`), wait until the node is
    idle, yield the cluster, then cancel its jobs and stop both daemons."""
    programs = require_programs(*PROGRAMS, root_for="slurmd must run as root to start jobs")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root=root, ctld_port=free_port(), slurmd_port=free_port(), cpus=os.cpu_count() or 1))
    cluster = SlurmCluster(root=root, conf=conf, node_name=NODE_NAME, partition=PARTITION,
                           env={"SLURM_CONF": str(conf)})
    with ExitStack() as stack:
        ctld = _start(stack, [programs["slurmctld"], "-D", "-f", str(conf)], log=root / "log" / "slurmctld.out")
        slurmd = _start(stack, [programs["slurmd"], "-D", "-N", NODE_NAME, "-f", str(conf)],
                        log=root / "log" / "slurmd.out")
        stack.callback(_shutdown, cluster=cluster, daemons=(ctld, slurmd))
        _wait_idle(cluster=cluster, daemons=(ctld, slurmd))
        yield cluster


def _start(stack: ExitStack, argv: list[str], *, log: Path) -> subprocess.Popen:
    out = stack.enter_context(log.open("w"))
    # Own session: the daemon runs in the foreground (-D), so its pid is the daemon's and nothing daemonises.
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_idle(*, cluster: SlurmCluster, daemons: tuple[subprocess.Popen, ...]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in daemons if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while starting; logs:\n{_log_tails(cluster.root)}")
        try:
            state = cluster.client("sinfo", "-h", "-o", "%t", timeout_s=5).stdout.strip()
        except subprocess.TimeoutExpired:
            state = "(sinfo timed out)"
        if state == "idle":
            return
        time.sleep(0.3)
    raise RuntimeError(f"node {NODE_NAME} not idle after {START_TIMEOUT_S:.0f} s (sinfo: {state!r}); logs:\n"
                       f"{_log_tails(cluster.root)}")


def _shutdown(*, cluster: SlurmCluster, daemons: tuple[subprocess.Popen, ...]) -> None:
    """Cancel leftover jobs (a failed test may leave one running), ask the controller to stop both daemons, then
    terminate / kill whichever of the two processes this module started is still alive."""
    for args in (("squeue", "-h", "-o", "%i"), ("scontrol", "shutdown")):
        try:
            result = cluster.client(*args, timeout_s=10)
        except subprocess.TimeoutExpired:
            continue
        if args[0] == "squeue" and result.stdout.split():
            _quiet(cluster.client, "scancel", *result.stdout.split(), timeout_s=10)
            time.sleep(1.0)  # slurmd reaps the job's steps before it is told to shut down
    for proc in daemons:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            stop_process(proc)


def _quiet(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except subprocess.TimeoutExpired:
        pass


def _log_tails(root: Path, *, lines: int = 20) -> str:
    parts = []
    for log in sorted((root / "log").glob("*")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(parts)
