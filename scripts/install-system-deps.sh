#!/usr/bin/env bash
# System packages the tests use for real components: numactl (NUMA binding through
# numactl), an etcd server (the etcd backend) and Slurm (srun --slurm). Installed with
# apt when missing and we are root; otherwise say what is missing (the tests that need
# it then fail with a clear message).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/install-etcd.sh" >/dev/null
bash "$root/scripts/install-slurm.sh" --quiet

# torch's TCPStore client and libuv server look up the name of every peer address. On
# loopback that address is the IPv4-mapped ::ffff:127.0.0.1 (torch's sockets are
# dual-stack), which /etc/hosts usually lacks: each lookup then leaves the machine for
# the network's resolver, and a resolver that drops a query in a burst stalls that
# client 5 s -- past the 5 s timeouts of the tests that start several torch clients at
# once (they failed that way under parallel load). Naming it here keeps the lookups on
# the machine. The name is not "localhost", whose forward lookups stay as they were.
if ! grep -qE '^[[:space:]]*::ffff:127\.0\.0\.1[[:space:]]' /etc/hosts 2>/dev/null; then
  if [[ -w /etc/hosts ]]; then
    echo "elastrun setup: adding ::ffff:127.0.0.1 (loopback as torch's sockets see it) to /etc/hosts"
    printf '::ffff:127.0.0.1 localhost-v4mapped\n' >> /etc/hosts
  else
    echo "elastrun setup: /etc/hosts has no ::ffff:127.0.0.1 line: torch's clients will ask the network's resolver for loopback's name (add '::ffff:127.0.0.1 localhost-v4mapped' as root)" >&2
  fi
fi
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
