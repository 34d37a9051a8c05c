#!/usr/bin/env bash
# Set up everything (venv, torch, test tools) and run the whole check: lint, types,
# layer contracts, then the test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh --quiet
bash scripts/install-system-deps.sh
py="$root/.venv/bin"
paths=(src tests examples benchmarks)
echo "== ruff"; "$py/ruff" check "${paths[@]}"
echo "== ruff format"; "$py/ruff" format --check "${paths[@]}"
echo "== mypy (strict)"; "$py/mypy"
echo "== import-linter"; "$py/lint-imports"
# Two workers, as CI has two cores; work stealing evens out the long end-to-end tests at
# the end. Each worker runs the conftest's leak checks on its own tests (the process tag
# is per test, the descriptor check per worker process). `-n 0` after it runs serially.
echo "== pytest"; "$py/python" -m pytest -n 2 --dist worksteal "$@"
