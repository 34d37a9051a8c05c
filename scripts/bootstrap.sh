#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with everything the
# demo, the tests and the benchmarks need. Safe to run again: it only installs what is
# missing. Usage: bash scripts/bootstrap.sh [--quiet]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
quiet=()
[[ "${1:-}" == "--quiet" ]] && quiet=(-q)

if [[ ! -x "$venv/bin/python" ]]; then
  echo "elastrun setup: creating $venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.elastrun-deps"
# The compiled engine of the workers' store is built by the install: a change to its
# source installs again.
want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/scripts/bootstrap.sh" "$root"/src/elastrun/store/torchwire/*.c | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
echo "elastrun setup: installing elastrun, torch 2.13.0 (CPU) and the test tools into .venv"
"$venv/bin/python" -m pip install "${quiet[@]}" --upgrade pip >/dev/null 2>&1 || true
# torch is pinned by exact version so that pip never reaches for a CUDA build.
# pip's own configuration on some machines names optional local indexes that do not
# exist; its warnings about them are noise, so they are filtered out.
# pip byte-compiles what it installs one file at a time (half the set-up's time, most of
# it torch); it is told not to. Python then writes each module's bytecode when it first
# imports it (a fraction of torch's files are ever imported), unless the environment sets
# PYTHONDONTWRITEBYTECODE: then compileall does it all here, on every core, or every
# process would compile torch from source (4.2 CPU-s an import instead of 2.2).
pip_install() {
  "$venv/bin/python" -m pip install "${quiet[@]}" --no-compile "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}
pip_install "torch==2.13.0"
pip_install -e "$root[test]"
if [[ -n "${PYTHONDONTWRITEBYTECODE:-}" ]]; then
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
fi
echo "$want" > "$stamp"
