#!/usr/bin/env bash
# The compiled engine of the workers' store (src/elastrun/store/torchwire/wirecore.c)
# under AddressSanitizer and UndefinedBehaviorSanitizer: built into a copy of src/, then
# the engines' tests (torch's own client against it, both engines at byte level and on
# random request sequences, both under a low descriptor limit, the agent's gloo groups
# through it and a flood of idle connections to it). Any report fails.
# Extra arguments go to pytest. Needs gcc and its libasan; not part of the CI run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh --quiet
py="$root/.venv/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r src "$work/src"
find "$work/src" -name '*.so' -delete
wire="$work/src/elastrun/store/torchwire"
include="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
    -fno-sanitize-recover=all -std=gnu11 -Wall -Wextra -Werror -I"$include" \
    "$wire/wirecore.c" -o "$wire/wirecore$suffix"
asan="$(readlink -f "$(gcc -print-file-name=libasan.so)")"
# libstdc++ is preloaded beside the sanitizer so that torch's C++ exceptions find it.
cxx="$(readlink -f "$(gcc -print-file-name=libstdc++.so)")"
logs="$work/logs"
mkdir "$logs"
status=0
PYTHONPATH="$work/src" LD_PRELOAD="$asan $cxx" \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$logs/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan" \
    ELASTRUN_WIRE_EXAMPLES="${ELASTRUN_WIRE_EXAMPLES:-2000}" \
    "$py" -m pytest -q -p no:cacheprovider \
    tests/contract/test_torchwire_engines.py tests/contract/test_torchwire.py \
    tests/process/test_torchwire_limits.py tests/e2e/test_agent_store.py "$@" || status=$?
if compgen -G "$logs/*" >/dev/null; then
    cat "$logs"/*
    echo "check-wirecore: the sanitizers reported the errors above" >&2
    exit 1
fi
exit "$status"
