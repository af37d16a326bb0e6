"""Two "nodes" on this machine: one sshd listening on 127.0.0.1 and 127.0.0.2, names in /etc/hosts, temp keys.

Recipe from docs/launcher-recipes.md (section 3): sshd -D -f <temp sshd_config>, /run/sshd must exist, pdsh over
ssh with PDSH_SSH_ARGS_APPEND="-F <ssh_config>". DeepSpeed's runner also runs a bare `ssh HOST hostname` check
(no way to pass -F), so `bin/ssh` here wraps the real ssh with the temp config: put it first on PATH, as a user's
~/.ssh/config would do on a real cluster.

Needs root (sshd, /etc/hosts), sshd, ssh, ssh-keygen; a missing one skips the test, or fails it under
DSMT_REQUIRE_LAUNCHERS=1 (CI), through launch_helpers.require_programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from launch_helpers import require_programs, stop_process, tiny_spec, write_run
from toolkit.launch.ports import free_port

HOSTS_FILE = Path("/etc/hosts")
NODES = {"dsmt-node-a": "127.0.0.1", "dsmt-node-b": "127.0.0.2"}
UNREACHABLE = ("dsmt-node-x", "127.0.0.9")  # in /etc/hosts, but no sshd listens there
SSHD = "/usr/sbin/sshd"
TRAIN_STEPS = 2


@dataclasses.dataclass(frozen=True)
class SshNodes:
    root: Path
    port: int
    ssh_config: Path
    bin_dir: Path  # holds the `ssh` wrapper
    names: tuple[str, ...]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment in which ssh, pdsh (-R ssh) and mpirun reach the nodes."""
        base = dict(os.environ if base is None else base)
        return {**base, "PATH": f"{self.bin_dir}{os.pathsep}{base.get('PATH', '')}",
                "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {self.ssh_config}",
                "OMPI_MCA_plm_rsh_agent": f"ssh -F {self.ssh_config}"}


@contextlib.contextmanager
def hosts_entries(entries: dict[str, str]) -> Iterator[None]:
    """Append the `address name` lines /etc/hosts lacks; remove only those lines afterwards."""
    present = HOSTS_FILE.read_text()
    known = {tuple(line.split()[:2]) for line in present.splitlines() if not line.startswith("#")}
    added = [f"{addr} {name}" for name, addr in entries.items() if (addr, name) not in known]
    if added:
        with HOSTS_FILE.open("a") as file:
            file.write(("" if present.endswith("\n") or not present else "\n") + "".join(a + "\n" for a in added))
    try:
        yield
    finally:
        if added:
            lines = HOSTS_FILE.read_text().splitlines(keepends=True)
            HOSTS_FILE.write_text("".join(line for line in lines if line.rstrip("\n") not in added))


def _write_configs(*, root: Path, port: int) -> tuple[Path, Path]:
    for key in ("host_ed25519", "client_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / key)], check=True, timeout=30)
    shutil.copy(root / "client_ed25519.pub", root / "authorized_keys")
    os.chmod(root / "authorized_keys", 0o600)
    listen = "".join(f"ListenAddress {addr}\n" for addr in sorted(set(NODES.values())))
    sshd_config = root / "sshd_config"
    sshd_config.write_text(
        f"Port {port}\n{listen}HostKey {root}/host_ed25519\nPidFile {root}/sshd.pid\n"
        f"AuthorizedKeysFile {root}/authorized_keys\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAcceptEnv *\n"
        "LogLevel VERBOSE\n")
    ssh_config = root / "ssh_config"
    ssh_config.write_text(
        f"Host *\n  Port {port}\n  User root\n  IdentityFile {root}/client_ed25519\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
        "  ConnectTimeout 5\n")
    return sshd_config, ssh_config


def _ssh_wrapper(*, bin_dir: Path, ssh_config: Path) -> None:
    bin_dir.mkdir()
    real_ssh = shutil.which("ssh")
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {real_ssh} -F {ssh_config} "$@"\n')
    wrapper.chmod(0o755)


def _wait_listening(*, proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(NODES.values())
    while pending and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {log.read_text()[-2000:]}")
        for addr in list(pending):
            with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=1):
                pending.discard(addr)
        time.sleep(0.1)
    if pending:
        raise RuntimeError(f"sshd not listening on {sorted(pending)}:{port} after {timeout_s} s: "
                           f"{log.read_text()[-2000:]}")


@contextlib.contextmanager
def sshd_nodes(root: Path) -> Iterator[SshNodes]:
    """sshd on both loopback addresses (a free port), the node names in /etc/hosts; always stopped afterwards."""
    require_programs(SSHD, "ssh", "ssh-keygen", root_for="sshd and /etc/hosts")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    port = free_port()
    sshd_config, ssh_config = _write_configs(root=root, port=port)
    _ssh_wrapper(bin_dir=root / "bin", ssh_config=ssh_config)
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # sshd's privilege-separation directory
    log = root / "sshd.log"
    with hosts_entries({**NODES, UNREACHABLE[0]: UNREACHABLE[1]}), log.open("w") as log_file:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(sshd_config)], stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_listening(proc=proc, port=port, log=log)
            yield SshNodes(root=root, port=port, ssh_config=ssh_config, bin_dir=root / "bin", names=tuple(NODES))
        finally:
            stop_process(proc)


def two_node_spec(*, output_dir: Path, hosts: tuple[str, ...] = tuple(NODES), **cluster) -> dict:
    """configs/tiny-cpu.yaml on len(hosts) nodes x 2 ranks, pdsh, a free master port, TRAIN_STEPS steps."""
    return tiny_spec(output_dir=output_dir, train_steps=TRAIN_STEPS,
                     cluster={"nodes": len(hosts), "gpus_per_node": 2, "hosts": list(hosts), "launcher": "pdsh",
                              "job_name": "two-nodes", **cluster},
                     training={"global_batch_size": 2 * 2 * len(hosts)})


def write_two_node_run(tmp_path: Path, **cluster) -> Path:
    return write_run(two_node_spec(output_dir=tmp_path / "out", **cluster), tmp_path / "run", source="two-nodes")
