"""Run directory paths that reach a shell dsmt cannot quote: DeepSpeed's pdsh runner sends them bare.

dsmt's own scripts quote every path they hold (`shlex.quote`), but launch_deepspeed.sh hands its directory to
`deepspeed`, and for launcher pdsh on several nodes DeepSpeed (runner.py `main`, multinode_runner.py
`PDSHRunner.get_cmd`, 0.19) builds the one command line pdsh gives each node's login shell from it, unquoted:
  `cd RUN_DIR;`                                  the working directory as os.path.abspath('.') gives it (symlinks
                                                 resolved), bare: a blank splits it, `$(...)` runs
  `export PYTHONPATH=RUN_DIR:...;`               bare, or inside "..." (where $ ` \\ " still act) once it holds a
                                                 character outside [\\w@%+=:,./-]
  `--config RUN_DIR/job.resolved.yaml --run-dir RUN_DIR`   the script's arguments: inside "..." when they hold a
                                                 blank, else bare
and pdsh replaces %h, %u and %n in that line before it runs. The characters of SAFE_CLASS pass all of these intact
(':' would also split PYTHONPATH; '~', '#', '{', '[' and '!' are special at some positions or in some shells).
The other ways dsmt launches do not go through such a shell: no_ssh and one-node runs start `deepspeed.launcher.
launch` locally, mpirun (openmpi) passes the arguments and the environment as data (DeepSpeed's "..." around a
PYTHONPATH it would quote for pdsh then stays in the value: odd, not run), torchrun and job.sbatch's srun take argv.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.spec.schema import JobSpec

# One bracket-expression body that Python's `re` and bash's patterns read the same way ('-' last is literal).
SAFE_CLASS = "a-zA-Z0-9/._+,@=-"
SAFE_WORDS = "letters, digits and '/', '.', '_', '-', '+', ',', '@', '='"
UNSAFE_GLOB = f"[!{SAFE_CLASS}]"  # launch_deepspeed.sh checks its own directory with it at run time
_UNSAFE = re.compile(f"[^{SAFE_CLASS}]")


def pdsh_gets_run_dir(spec: JobSpec) -> bool:
    """Whether launch_deepspeed.sh runs DeepSpeed's pdsh runner, the one that sends the run directory bare (on one
    node, SLURM's included, DeepSpeed starts the ranks locally)."""
    return spec.cluster.launcher == "pdsh" and spec.cluster.nodes > 1


def check_run_dir(*, spec: JobSpec, run_dir: Path) -> None:
    """Raise `[unsafe_path]` for a run directory (absolute) a generated launch cannot carry; call it before writing.

    A newline is refused for every launcher; the characters outside SAFE_CLASS only where pdsh_gets_run_dir, checked
    in the path as given and as the kernel resolves it (what DeepSpeed's os.path.abspath('.') returns there)."""
    if "\n" in str(run_dir):
        raise DsmtError(f"[unsafe_path] run directory {str(run_dir)!r} contains a newline, which ends the line of "
                        "every script and file that names it; nothing was written\nfix: choose an output directory "
                        "on one line")
    if not pdsh_gets_run_dir(spec):
        return
    for form in dict.fromkeys([str(run_dir), os.path.realpath(run_dir)]):
        unsafe = list(dict.fromkeys(_UNSAFE.findall(form)))
        if unsafe:
            resolved = "" if form == str(run_dir) else f" (resolved: {form!r})"
            raise DsmtError(_unsafe_message(spec=spec, run_dir=str(run_dir), resolved=resolved, unsafe=unsafe))


def _unsafe_message(*, spec: JobSpec, run_dir: str, resolved: str, unsafe: list[str]) -> str:
    characters = ", ".join(repr(ch) for ch in unsafe)
    return (f"[unsafe_path] run directory {run_dir!r}{resolved} contains {characters}, which DeepSpeed's pdsh runner "
            f"(cluster.launcher: pdsh, {spec.cluster.nodes} nodes) passes unquoted to each node's shell "
            "(`cd RUN_DIR; ... --run-dir RUN_DIR`): that shell would split the path or run part of it as a command; "
            f"nothing was written\nfix: choose an output directory made of {SAFE_WORDS} (e.g. --out runs/exp-1), or "
            "--set cluster.launcher=no_ssh (then bash launch_deepspeed.sh NODE_RANK on each node: no remote shell)")
