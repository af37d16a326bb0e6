"""`dsmt preflight RUN_DIR`: before a long job, check from the head node that every node can run it.

Each host is reached the way the launch reaches it (cluster.launcher pdsh: pdsh over ssh, honouring
PDSH_SSH_ARGS_APPEND, with the PYTHON* variables DeepSpeed exports; openmpi: mpirun; hosts 'slurm': srun inside
the allocation; no_ssh: this node only) and runs `toolkit.launch.preflight_probe` with the head's python path. The head
compares the facts: dsmt / torch / DeepSpeed / megatron-core versions, GPUs per node (cuda), the run directory and
its .deepspeed_env at the same path, the NCCL / gloo interfaces and IB HCAs it names, the master port, and on GPU
runs the kernels each node must load or compile (toolkit/check/preflight_kernels.py). Every remote call is bounded:
a hung host fails its check, it does not hang preflight.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from shlex import quote

from toolkit.check.preflight_kernels import compile_problems, kernel_problems
from toolkit.errors import DsmtError, Problem, Report
from toolkit.launch.preflight_probe import MARKER, facts

CONNECT_TIMEOUT_S = 5
REMOTE_TIMEOUT_S = 120  # a GPU node's probe imports TE and DeepSpeed and compiles a kernel cold: 10-60 s
EXPORT_PREFIXES = ("PYTHON", "MLFLOW", "MV2", "UCX")  # what DeepSpeed's runner exports to the other nodes
NO_PYTHON = f"{MARKER}_NO_PYTHON"
_PDSH_LINE = re.compile(r"^(?:pdsh@[^:]+: )?([^\s:]+): (.*)$")


def register(subparsers) -> None:
    parser = subparsers.add_parser("preflight", help="check from the head node that every node can run RUN_DIR")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a directory written by `dsmt generate`")
    parser.add_argument("--python", default=sys.executable,
                        help="the python path the nodes run (default: this one, as the DeepSpeed launcher does)")
    parser.add_argument("--timeout", type=int, default=REMOTE_TIMEOUT_S, help="seconds for all remote probes")
    parser.set_defaults(func=run_preflight_command)


def run_preflight_command(args: argparse.Namespace) -> int:
    report = preflight(run_dir=args.run_dir, python=args.python, env=dict(os.environ), timeout_s=args.timeout)
    print(report.to_text())
    return 0 if report.ok else DsmtError.exit_code


def preflight(*, run_dir: Path, python: str, env: dict[str, str], timeout_s: int = REMOTE_TIMEOUT_S) -> Report:
    """One report for RUN_DIR: errors for what would stop or slow the job on some node, infos for what passed."""
    spec, run_dir = _load_run_spec(run_dir)
    source = f"dsmt preflight {run_dir}"
    launcher, hosts, problems = _launcher_and_hosts(spec=spec, env=env)
    if problems:
        return Report(source=source, problems=tuple(problems))
    device, port = spec.cluster.device, spec.cluster.master_port
    probe_args = ["--run-dir", str(run_dir), "--device", device, "--port", str(port)]
    if launcher == "local":
        checked = hosts[:1]
        answer = _probe_here(python=python, probe_args=probe_args, env=env, timeout_s=timeout_s)
        answers = {checked[0]: answer} if answer else {}
        failures = {} if answer else {checked[0]: "python missing" if not Path(python).is_file() else "no answer"}
        if len(hosts) > 1:
            problems.append(Problem("warning", "preflight_not_checked", f"cluster.launcher=no_ssh: only this node is "
                                    f"checked; {hosts[1:]} are not", "run `dsmt preflight` on each of them too"))
    else:
        checked = hosts
        if launcher == "pdsh":
            problems += deepspeed_ssh_check(host=hosts[0], env=env)
        answers, failures = reach_hosts(launcher=launcher, hosts=hosts, python=python, probe_args=probe_args,
                                        env=env, timeout_s=timeout_s)
    # the head's facts are what the nodes are compared with (versions, .deepspeed_env): no GPU kernels imported or
    # compiled here (a login node may have no GPU; the nodes report their own)
    head = facts(run_dir=run_dir, device="cpu")
    problems += _reach_problems(launcher=launcher, hosts=checked, answers=answers, failures=failures, python=python)
    problems += compare_nodes(head=head, answers=answers, device=device, slots=spec.cluster.gpus_per_node)
    problems += kernel_problems(spec=spec, answers=answers)
    problems += compile_problems(spec=spec, answers=answers)
    master = spec.cluster.master_addr if spec.cluster.master_addr in checked else checked[0]
    problems += _master_port_problems(hosts=checked, answers=answers, port=port, master=master)
    return Report(source=source, problems=tuple(problems))


def _load_run_spec(run_dir: Path):
    from toolkit.spec.load import read_spec_file, validate_spec

    run_dir = run_dir.resolve()
    spec_path = run_dir / "job.resolved.yaml"
    if not spec_path.is_file():
        raise DsmtError(f"preflight needs a run directory written by `dsmt generate`: {spec_path} does not exist; "
                        "run `dsmt generate JOB --out RUN_DIR` first")
    return validate_spec(read_spec_file(spec_path), source=str(spec_path)), run_dir


def _launcher_and_hosts(*, spec, env: dict[str, str]) -> tuple[str, list[str], list[Problem]]:
    """How the nodes are reached ('pdsh', 'mpirun', 'srun' or 'local'), the hosts, and problems that stop here."""
    from toolkit.generate.hostfile import host_names, is_local

    if spec.cluster.hosts == "slurm":
        launcher, (hosts, problems) = "srun", _slurm_hosts(env=env)
        if hosts and len(hosts) != spec.cluster.nodes:
            problems = [Problem("error", "preflight_slurm_allocation", f"the allocation has {len(hosts)} node(s) "
                                f"{hosts} but cluster.nodes={spec.cluster.nodes}", f"salloc -N {spec.cluster.nodes}, "
                                f"or regenerate with --set cluster.nodes={len(hosts)}")]
    elif is_local(spec) or spec.cluster.launcher == "no_ssh":
        return "local", host_names(spec), []
    else:
        launcher, hosts, problems = {"pdsh": "pdsh", "openmpi": "mpirun"}[spec.cluster.launcher], host_names(spec), []
    if not problems and shutil.which(launcher, path=env.get("PATH")) is None:
        problems = [Problem("error", "preflight_launcher_missing", f"{launcher} (cluster.launcher="
                            f"{spec.cluster.launcher}, hosts={spec.cluster.hosts!r}) is not on "
                            f"PATH={env.get('PATH', '')}",
                            f"install {launcher} on this node (scripts/install_launchers.sh), or regenerate with "
                            "--set cluster.launcher=no_ssh and run the launch script on every node")]
    return launcher, hosts, problems


def _slurm_hosts(*, env: dict[str, str]) -> tuple[list[str], list[Problem]]:
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return [], [Problem("error", "preflight_slurm_allocation", "cluster.hosts is 'slurm' but SLURM_JOB_NODELIST "
                            "is unset: this is not inside an allocation", "run it inside one: salloc -N NODES "
                            "dsmt preflight RUN_DIR")]
    if shutil.which("scontrol", path=env.get("PATH")) is None:
        return [], [Problem("error", "preflight_launcher_missing", "scontrol is not on PATH inside the allocation",
                            "install slurm-client on this node")]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, env=env,
                             timeout=CONNECT_TIMEOUT_S * 2)
    except subprocess.TimeoutExpired:
        out = subprocess.CompletedProcess([], 1, "", f"timed out after {CONNECT_TIMEOUT_S * 2} s")
    if out.returncode != 0 or not out.stdout.split():
        return [], [Problem("error", "preflight_slurm_allocation", f"scontrol show hostnames {nodelist} failed: "
                            f"{_last_lines(out.stderr)}", "check the controller answers (sinfo) and SLURM_CONF")]
    return out.stdout.split(), []


def deepspeed_ssh_check(*, host: str, env: dict[str, str]) -> list[Problem]:
    """DeepSpeed's runner first runs a bare `ssh HOST hostname` (no PDSH_SSH_ARGS_APPEND): it must work too."""
    argv = ["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", "-o",
            f"ConnectTimeout={CONNECT_TIMEOUT_S}", host, "hostname"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=CONNECT_TIMEOUT_S * 3,
                              stdin=subprocess.DEVNULL)
        ok, why = done.returncode == 0, _last_lines(done.stderr) or f"exit code {done.returncode}"
    except (subprocess.TimeoutExpired, OSError) as err:
        ok, why = False, str(err)
    if ok:
        return []
    return [Problem("error", "preflight_deepspeed_ssh", f"{host}: `ssh {host} hostname` failed ({why}); the DeepSpeed "
                    "launcher runs it before pdsh, without PDSH_SSH_ARGS_APPEND, and stops when it fails",
                    f"put the ssh options for {host} in ~/.ssh/config (Host {host} ...), so plain ssh reaches it")]


def _probe_command(*, python: str, probe_args: list[str], env: dict[str, str]) -> str:
    """The shell line each node runs: DeepSpeed's exports, then the probe with the head's python path."""
    exports = "".join(f"export {k}={quote(v)}; " for k, v in env.items() if k.startswith(EXPORT_PREFIXES))
    node_id = "${SLURMD_NODENAME:-${OMPI_COMM_WORLD_RANK:-}}"
    probe = " ".join(quote(word) for word in [python, "-m", "toolkit.launch.preflight_probe", *probe_args])
    return f'{exports}if [ -x {quote(python)} ]; then {probe}; else echo {NO_PYTHON} "{node_id}"; fi'


def _launch_command(*, launcher: str, hosts: list[str], command: str, timeout_s: int) -> list[str]:
    if launcher == "pdsh":  # as DeepSpeed's PDSHRunner: rcmd ssh; ssh options from PDSH_SSH_ARGS_APPEND
        return ["pdsh", "-S", "-R", "ssh", "-t", str(CONNECT_TIMEOUT_S), "-u", str(timeout_s), "-w", ",".join(hosts),
                command]
    if launcher == "mpirun":  # rank i on hosts[i]; the plm_rsh_agent comes from the environment (OMPI_MCA_*)
        return ["mpirun", "-np", str(len(hosts)), "--host", ",".join(f"{h}:1" for h in hosts), "bash", "-c", command]
    return ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            "bash", "-c", command]


def reach_hosts(*, launcher: str, hosts: list[str], python: str, probe_args: list[str], env: dict[str, str],
                timeout_s: int) -> tuple[dict[str, dict], dict[str, str]]:
    """Run the probe on every host through `launcher`: (host -> facts, host -> why there is no answer)."""
    command = _probe_command(python=python, probe_args=probe_args, env=env)
    argv = _launch_command(launcher=launcher, hosts=hosts, command=command, timeout_s=timeout_s)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s + 10,
                              stdin=subprocess.DEVNULL)
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        stdout, stderr = _text(err.stdout), _text(err.stderr) + f"\n{launcher} timed out after {timeout_s + 10} s"
    answers, failures = _parse(launcher=launcher, hosts=hosts, stdout=stdout, stderr=stderr)
    for host in hosts:
        if host not in answers and host not in failures:
            failures[host] = _last_lines(stderr) or f"{launcher} returned no answer"
    return answers, failures


def _parse(*, launcher: str, hosts: list[str], stdout: str, stderr: str) -> tuple[dict[str, dict], dict[str, str]]:
    answers: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for line in stdout.splitlines():
        host, text = _split_host(launcher=launcher, line=line)
        if text.startswith(NO_PYTHON):
            failures[host or _host_of(text.split()[1:], hosts=hosts)] = "python missing"
        elif text.startswith(MARKER + " "):
            answer = json.loads(text[len(MARKER) + 1:])
            answers[host or _host_of([answer.get("node") or ""], hosts=hosts)] = answer
    if launcher == "pdsh":
        for line in stderr.splitlines():
            host, text = _split_host(launcher=launcher, line=line)
            if host in hosts and host not in answers:
                failures[host] = (failures.get(host, "") + " " + text).strip()
    return answers, failures


def _split_host(*, launcher: str, line: str) -> tuple[str | None, str]:
    match = _PDSH_LINE.match(line) if launcher == "pdsh" else None
    return (match.group(1), match.group(2)) if match else (None, line)


def _host_of(ids: list[str], *, hosts: list[str]) -> str:
    """srun reports the node name, mpirun the rank (rank i runs on hosts[i])."""
    node = ids[0] if ids else ""
    return hosts[int(node)] if node.isdigit() and int(node) < len(hosts) else node


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _last_lines(text: str, count: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-count:])


def _probe_here(*, python: str, probe_args: list[str], env: dict[str, str], timeout_s: int) -> dict | None:
    if not Path(python).is_file():
        return None
    try:
        done = subprocess.run([python, "-m", "toolkit.launch.preflight_probe", *probe_args], capture_output=True, text=True,
                              env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER + " ")]
    return json.loads(lines[0][len(MARKER) + 1:]) if lines else None


def _reach_problems(*, launcher: str, hosts: list[str], answers: dict, failures: dict, python: str) -> list[Problem]:
    problems = []
    for host, why in failures.items():
        if why == "python missing":
            problems.append(Problem("error", "preflight_python_missing", f"{host}: python {python} does not exist",
                                    "install the same environment at the same path on every node (or a shared "
                                    "filesystem), or pass --python with the path the nodes use"))
        else:
            problems.append(Problem("error", "preflight_unreachable",
                                    f"{host}: not reachable through {launcher}: {why}",
                                    _reach_fix(launcher)))
    if answers:
        how = "checked on this node" if launcher == "local" else f"reached through {launcher}"
        problems.append(Problem("info", "preflight_reachable", f"{', '.join(h for h in hosts if h in answers)}: "
                                f"{how}, probe ran with {python}"))
    return problems


def _reach_fix(launcher: str) -> str:
    return {"pdsh": "check `ssh HOST true` works without a password (PDSH_SSH_ARGS_APPEND / ~/.ssh/config), that the "
                    "host name is right, and that sshd runs there",
            "mpirun": "check `mpirun -np 1 --host HOST true` works (ssh keys, OMPI_MCA_plm_rsh_agent)",
            "srun": "check the node is up in the allocation (sinfo), and srun works there"}.get(launcher, "")


def compare_nodes(*, head: dict, answers: dict[str, dict], device: str, slots: int) -> list[Problem]:
    """Versions, run directory, .deepspeed_env, interfaces, IB HCAs and GPUs of each node against the head."""
    problems = []
    for host, node in answers.items():
        problems += _version_problems(host=host, head=head, node=node)
        problems += _run_dir_problems(host=host, head=head, node=node)
        problems += _network_problems(host=host, node=node)
        if device == "cuda" and node.get("gpu_count") != slots:
            problems.append(Problem("error", "preflight_gpu_count", f"{host}: {node.get('gpu_count')} GPUs visible, "
                                    f"cluster.gpus_per_node={slots}", "fix the node (nvidia-smi) or "
                                    "CUDA_VISIBLE_DEVICES, or regenerate with --set cluster.gpus_per_node=N"))
    if answers and not problems:
        problems.append(Problem("info", "preflight_nodes_match", f"{len(answers)} node(s): versions "
                                f"{_versions_text(head['versions'])}, run dir and .deepspeed_env, network settings OK"))
    if device != "cuda":
        problems.append(Problem("info", "preflight_gpu_count", f"device={device}: the GPU count is not applicable"))
    return problems


def _versions_text(versions: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def _version_problems(*, host: str, head: dict, node: dict) -> list[Problem]:
    differ = {name: (head["versions"].get(name), version) for name, version in node["versions"].items()
              if version != head["versions"].get(name)}
    if not differ:
        return []
    seen = ", ".join(f"{name} {here} here but {there} on {host}" for name, (here, there) in differ.items())
    return [Problem("error", "preflight_versions", f"{host} ({node['python']}): {seen}",
                    "install the same versions on every node (the same environment at the same path)")]


def _run_dir_problems(*, host: str, head: dict, node: dict) -> list[Problem]:
    if not node["run_dir_readable"]:
        return [Problem("error", "preflight_run_dir", f"{host}: the run directory is not readable at the same path",
                        "put the run directory on a filesystem every node mounts at the same path")]
    if node["env_file_sha256"] != head["env_file_sha256"]:
        return [Problem("error", "preflight_env_file", f"{host}: .deepspeed_env differs from this node's (or is "
                        "missing)", "use one shared run directory; regenerate instead of editing copies")]
    return []


def _network_problems(*, host: str, node: dict) -> list[Problem]:
    env, problems = node.get("env") or {}, []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        missing = _missing_names(env.get(var), available=node["interfaces"], prefix_match=var.startswith("NCCL"))
        if missing:
            problems.append(Problem("error", "preflight_interface", f"{host}: {var}={env[var]} but no interface "
                                    f"{missing}; interfaces there: {node['interfaces']}",
                                    "regenerate with --set cluster.network_interface=<one of them>"))
    missing = _missing_names(env.get("NCCL_IB_HCA"), available=node["ib_devices"], prefix_match=True)
    if missing:
        problems.append(Problem("error", "preflight_ib_hca", f"{host}: NCCL_IB_HCA={env['NCCL_IB_HCA']} but no "
                                f"device {missing} in /sys/class/infiniband (there: {node['ib_devices']})",
                                "set communication.nccl_ib_hca to devices from `ibv_devices`, or unset it"))
    return problems


def _missing_names(value: str | None, *, available: list[str], prefix_match: bool) -> list[str]:
    """Names of an NCCL-style list ('eth0,ib', '=eth0', '^docker') that match nothing; exclusions never miss."""
    if not value or value.startswith("^"):
        return []
    exact = value.startswith("=") or not prefix_match
    names = [item.split(":")[0] for item in value.lstrip("=").split(",") if item]
    return [n for n in names if not any(a == n or (not exact and a.startswith(n)) for a in available)]


def _master_port_problems(*, hosts: list[str], answers: dict, port: int, master: str) -> list[Problem]:
    node = answers.get(master)
    if node is None:
        return [Problem("error", "preflight_master_port", f"master_port={port} on {master}: not checked, the "
                        "master host did not answer", "fix the reachability problem above first")]
    if not node["port_free"]:
        return [Problem("error", "preflight_master_port", f"master_port={port} is in use on the master host {master}",
                        "stop what listens there (ss -ltnp), or regenerate with --set cluster.master_port=<free>")]
    return [Problem("info", "preflight_master_port", f"master_port={port} is free on {master}")]
