#!/usr/bin/env bash
# Set up everything (venv, torch, test tools) and run the whole check: lint, types,
# layer contracts, then the test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The suite starts a few thousand Python processes (agents, templates, workers, stores)
# that import elastrun and torch. Where the environment sets PYTHONDONTWRITEBYTECODE no
# .pyc is ever written, and every one of them compiled elastrun from source again (0.3
# CPU-s a launch), as pytest did each test module in each worker. The suite lets Python
# write its bytecode (into the ignored __pycache__ folders; torch's on first import) and
# compiles src/ once up front.
unset PYTHONDONTWRITEBYTECODE
bash scripts/bootstrap.sh --quiet
bash scripts/install-system-deps.sh
py="$root/.venv/bin"
"$py/python" -m compileall -q -j 0 src >/dev/null
paths=(src tests examples benchmarks)
echo "== ruff"; "$py/ruff" check "${paths[@]}"
echo "== ruff format"; "$py/ruff" format --check "${paths[@]}"
echo "== import-linter"; "$py/lint-imports"
# mypy takes half a minute on one core: it runs beside the test suite, which leaves a core
# idle now and then, and its report follows the suite's.
mypy_log="$(mktemp)"
trap 'rm -f "$mypy_log"' EXIT
"$py/mypy" >"$mypy_log" 2>&1 &
mypy_pid=$!
# Three workers on CI's two cores: most tests wait (a timeout, a peer, a sleeping worker),
# and a third keeps both cores busy (fresh clones: pytest 468-505 s against about 550 s
# for two). Work stealing evens out the long end-to-end tests at the end. Each worker runs
# the conftest's leak checks on its own tests (the process tag is per test, the
# descriptor check per worker process). `-n 0` after it runs serially.
echo "== pytest"
status=0
"$py/python" -m pytest -n 3 --dist worksteal --durations=25 "$@" || status=$?
echo "== mypy (strict)"
wait "$mypy_pid" || status=1
cat "$mypy_log"
exit "$status"
