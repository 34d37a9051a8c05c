#!/usr/bin/env bash
# Set up everything and run the main demo: elastic DDP training of 4 gloo workers on
# the CPU, with checkpoints, one worker crash injected and recovered from.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Python writes the bytecode of what it imports (see scripts/bootstrap.sh).
unset PYTHONDONTWRITEBYTECODE
bash scripts/bootstrap.sh --quiet
work="$(mktemp -d -t elastrun-demo.XXXXXX)"
trap 'rm -rf "$work"' EXIT
set -x
"$root/.venv/bin/elastrun" --nproc-per-node 4 --max-restarts 3 \
  examples/ddp_demo.py --steps 60 --checkpoint-dir "$work/ckpt" \
  --crash-at-step 35 --crash-rank 2 --crash-mode kill
