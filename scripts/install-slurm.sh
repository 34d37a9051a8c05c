#!/usr/bin/env bash
# Install Slurm (Debian's slurm-wlm: slurmctld, slurmd, srun) for the end-to-end test of
# `srun elastrun --slurm` (tests/e2e/test_slurm.py). The test writes its own slurm.conf
# and starts its own daemons; nothing is configured or started here, and no service is
# enabled. Safe to run again: it does nothing when the commands are already there.
# Usage: bash scripts/install-slurm.sh [--quiet]
set -euo pipefail
quiet=()
[[ "${1:-}" == "--quiet" ]] && quiet=(-q)

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install-slurm: apt-get not found; install slurmctld, slurmd and srun yourself" >&2
  exit 1
fi
sudo=()
if [[ "$(id -u)" != 0 ]]; then
  if ! command -v sudo >/dev/null; then
    echo "install-slurm: must run as root (or with sudo) to install slurm-wlm" >&2
    exit 1
  fi
  sudo=(sudo)
fi
echo "install-slurm: installing slurm-wlm (Debian's Slurm packages)"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update "${quiet[@]}" >/dev/null
# The packages try to start their services; in containers policy-rc.d refuses, which is
# what we want: the test runs its own daemons with its own configuration.
"${sudo[@]}" apt-get install -y "${quiet[@]}" --no-install-recommends slurm-wlm >/dev/null
command -v srun >/dev/null
