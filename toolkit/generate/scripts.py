"""Launch scripts: launch_deepspeed.sh, launch_torchrun.sh (per node, c10d rendezvous) and job.sbatch.

The shell lives in the templates of launch/ (toolkit/generate/templates.py loads them, or a site's copies); this
module computes what they receive. Every value from the spec is validated by the schema and still passed through
`shlex.quote`; the scripts run under `set -euo pipefail` and are shellcheck-clean (tests run shellcheck on each).
DeepSpeed's pdsh runner passes the run directory on unquoted: toolkit/generate/remote_shell.py checks it.
They launch `toolkit.train --config job.resolved.yaml --run-dir DIR` from the run directory, which must be on a
filesystem all nodes see: the trainer reads DIR/ds_config.json (edited tuning keys win; layout, batch, precision
and ZeRO keys must agree with the spec) and DIR/megatron.json (must agree), see toolkit/train/job/run_files.py.
"""

from __future__ import annotations

from shlex import quote
from typing import Any

from toolkit.generate.hostfile import LOOPBACK_ADDR, is_local, master_address
from toolkit.generate.remote_shell import UNSAFE_GLOB
from toolkit.generate.templates import LaunchTemplates
from toolkit.spec.layout import RunLayout
from toolkit.spec.schema import JobSpec

# What a rank that stopped on SIGTERM after saving leaves in its heartbeat (toolkit/launch/heartbeat.py, which sits
# above this package; tests/generate/test_gen_paths.py holds the two equal): job.sbatch turns it into exit 75.
RANK0_HEARTBEAT = "logs/rank0.heartbeat.json"
STOPPED_ON_SIGTERM = "stopped on SIGTERM"

TRAIN_MODULE = "toolkit.train"
RESOLVED_SPEC = "job.resolved.yaml"


def render_launch_deepspeed(*, spec: JobSpec, layout: RunLayout, templates: LaunchTemplates,
                            train_module: str = TRAIN_MODULE) -> str:
    launcher = spec.cluster.launcher
    context = {**_common_context(spec=spec, layout=layout, train_module=train_module),
               "launcher": launcher, "one_machine": is_local(spec),
               "per_node": launcher == "no_ssh" and not is_local(spec),
               "mpirun_args": quote(" ".join(_mpirun_args(spec=spec))), "unsafe_path_glob": UNSAFE_GLOB}
    return templates.render(name="launch_deepspeed.sh", context=context)


def _mpirun_args(*, spec: JobSpec) -> list[str]:
    """DeepSpeed's OpenMPI runner: one `mpirun -n WORLD -hostfile ...` starts every rank (ranks read
    OMPI_COMM_WORLD_*; `-x` forwards the rendezvous address). On one node mpirun forks locally, so the script forces
    the multi-node runner and skips DeepSpeed's ssh pre-check. DeepSpeed defaults to `btl_tcp_if_include eth0`;
    the spec's interface (or lo on one node) replaces it. As root mpirun also needs --allow-run-as-root or
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 from the caller: the script never grants that."""
    mpirun_args = ["-x", "MASTER_ADDR", "-x", "MASTER_PORT"]
    iface = mpirun_interface(spec)
    if iface:
        mpirun_args += ["--mca", "btl_tcp_if_include", iface]
    return mpirun_args


def mpirun_interface(spec: JobSpec) -> str | None:
    """The interface mpirun's TCP transport uses: loopback on one node (whatever cluster.network_interface says,
    summary.txt notes it), else the spec's (None: DeepSpeed's eth0)."""
    return "lo" if is_local(spec) else spec.cluster.network_interface


def render_launch_torchrun(*, spec: JobSpec, layout: RunLayout, templates: LaunchTemplates,
                           train_module: str = TRAIN_MODULE) -> str:
    context = {**_common_context(spec=spec, layout=layout, train_module=train_module),
               "job_name": quote(spec.cluster.job_name)}
    return templates.render(name="launch_torchrun.sh", context=context)


def _common_context(*, spec: JobSpec, layout: RunLayout, train_module: str) -> dict[str, Any]:
    """What both launch_*.sh templates receive: the layout for the header, the rendezvous, the trainer."""
    return {"nodes": layout.nodes, "gpus_per_node": layout.gpus_per_node, "world_size": layout.world_size,
            "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "device": spec.cluster.device,
            "slurm": spec.cluster.hosts == "slurm", "master_addr": quote(master_address(spec) or LOOPBACK_ADDR),
            "master_port": spec.cluster.master_port, "train_module": quote(train_module),
            "resolved_spec": RESOLVED_SPEC}


def render_sbatch(*, spec: JobSpec, layout: RunLayout, run_dir: str, templates: LaunchTemplates,
                  train_module: str = TRAIN_MODULE) -> str:
    """SLURM batch script: one srun task per node runs torchrun; rendezvous on the first allocated node, no ssh.

    `run_dir` is baked in, one quoted shell word, because sbatch runs a spooled copy of the script (BASH_SOURCE is
    not the run dir); DSMT_RUN_DIR overrides it after a move. cluster.slurm's setup lines run after .deepspeed_env,
    before srun. training.preemption_grace_s becomes `--signal=TERM@N` (the template's comment says why not B:).
    """
    slurm = spec.cluster.slurm
    context = {"sbatch_directives": sbatch_directives(spec=spec, layout=layout),
               "run_dir": quote(run_dir), "setup_lines": list(slurm.setup),
               "srun_args": [quote(word) for word in slurm.srun_args], "gpus_per_node": layout.gpus_per_node,
               "cpus_per_task": cpus_per_task(spec=spec, layout=layout),
               "master_port": spec.cluster.master_port, "train_module": quote(train_module),
               "resolved_spec": RESOLVED_SPEC, "preemption_grace_s": spec.training.preemption_grace_s,
               # a relative output_dir is taken in the run directory, where the script runs srun, as the ranks do
               "heartbeat_file": quote(f"{spec.training.output_dir}/{RANK0_HEARTBEAT}"),
               "stopped_marker": quote(STOPPED_ON_SIGTERM)}
    return templates.render(name="job.sbatch", context=context)


def sbatch_directives(*, spec: JobSpec, layout: RunLayout) -> list[str]:
    """The `#SBATCH` options, each one sbatch word: sbatch splits directive lines on blanks, honours '...' / "..."
    quotes and treats an unquoted '#' as a comment, so `shlex.quote` keeps `--account=a b` one option."""
    slurm = spec.cluster.slurm
    directives = [f"--job-name={spec.cluster.job_name}", f"--nodes={layout.nodes}", "--ntasks-per-node=1",
                  f"--cpus-per-task={cpus_per_task(spec=spec, layout=layout)}"]
    if spec.cluster.device == "cuda":
        directives.append(f"--gpus-per-node={layout.gpus_per_node}")
    for name in ("account", "partition", "time", "qos"):
        if getattr(slurm, name) is not None:
            directives.append(f"--{name}={getattr(slurm, name)}")
    return [quote(d) for d in [*directives, *slurm.extra_sbatch]]


CPUS_PER_GPU_RANK = 8  # a GPU rank's host side: its Python process, dataloader workers, NCCL's proxy threads


def cpus_per_task(*, spec: JobSpec, layout: RunLayout) -> int:
    """Cores for each node's one srun task (torchrun and its ranks): cluster.slurm.cpus_per_task, else 8 per GPU
    rank, or one per rank on the CPU (each computes on one thread)."""
    if spec.cluster.slurm.cpus_per_task is not None:
        return spec.cluster.slurm.cpus_per_task
    per_rank = CPUS_PER_GPU_RANK if spec.cluster.device == "cuda" else 1
    return per_rank * layout.gpus_per_node
