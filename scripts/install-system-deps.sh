#!/usr/bin/env bash
# System packages the tests use for real components: numactl (NUMA binding through
# numactl), an etcd server (the etcd backend) and Slurm (srun --slurm). Installed with
# apt when missing and we are root; otherwise say what is missing (the tests that need
# it then fail with a clear message).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-etcd.sh" >/dev/null
bash "$root/scripts/install-slurm.sh" --quiet
missing=()
command -v numactl >/dev/null 2>&1 || missing+=(numactl)
if (( ${#missing[@]} == 0 )); then
  exit 0
fi
if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "elastrun setup: installing ${missing[*]} with apt"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "elastrun setup: please install: ${missing[*]}" >&2
fi
