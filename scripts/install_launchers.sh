#!/usr/bin/env bash
# Debian's SLURM, Open MPI, OpenSSH server and pdsh for tests/launch (they start the daemons they need on
# 127.0.0.x and stop them). Idempotent; needs root (or sudo) and apt-get.
set -euo pipefail
PACKAGES=(slurm-wlm openmpi-bin openssh-server pdsh)
missing=()
for program in slurmctld slurmd sbatch mpirun sshd pdsh; do
    command -v "$program" >/dev/null || [ -x "/usr/sbin/$program" ] || missing+=("$program")
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_launchers.sh: ${missing[*]} missing; run as root or install: ${PACKAGES[*]}" >&2; exit 2; }
    SUDO=sudo
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
