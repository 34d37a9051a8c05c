#!/usr/bin/env bash
# The GPU measurements, in one run on a machine with a GPU lent for a few minutes: the
# first thing to run there. It installs elastrun from the working tree into the
# interpreter that holds torch (built there, for its Python: nothing to carry; without a
# C compiler the workers' store runs in Python), then runs each benchmark under its own
# time bound, in order of priority, and leaves their tables under $OUT (at most 8 files:
# each benchmark's .md and .json, and summary.txt with every log's tail).
#
#     bash benchmarks/gpu_session.sh          (the device's run, from the repository root)
#
# GPU_SESSION_DEVICE=cpu GPU_SESSION_PROFILE=--smoke GPU_SESSION_PYTHON=.venv/bin/python
# GPU_SESSION_INSTALL=0 runs the same steps on this machine, to try the script first
# (GPU_SESSION_INSTALL=src: straight to the fallback below).
set -u
out=${OUT:-/tmp/elastrun-gpu-session}
device=${GPU_SESSION_DEVICE:-cuda}
profile=${GPU_SESSION_PROFILE:---quick}
py=${GPU_SESSION_PYTHON:-python3}
mkdir -p "$out"
logs=$(mktemp -d)
summary="$out/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1

if [ "${GPU_SESSION_INSTALL:-1}" != 0 ]; then
    # Built there (setuptools >= 77); where it cannot be, the tree's src on the path of
    # every process (the workers inherit it) and the entry point beside the interpreter,
    # where the benchmarks look for it.
    if [ "${GPU_SESSION_INSTALL:-1}" = src ] \
        || ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation . \
            >"$logs/install.log" 2>&1; then
        echo "(no build there: elastrun runs from src/)" >>"$summary"
        tail -n 5 "$logs/install.log" >>"$summary"
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
        bin=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
        printf '#!%s\nimport sys\nfrom elastrun.launch.entry import main\nsys.exit(main())\n' \
            "$("$py" -c 'import sys; print(sys.executable)')" >"$bin/elastrun"
        chmod +x "$bin/elastrun"
    fi
fi
{
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
    "$py" -c 'import torch, elastrun; print("torch", torch.__version__, "elastrun", elastrun.__file__)'
} >>"$summary" 2>&1

step() {  # name, bound (s), command...
    local name=$1 bound=$2
    shift 2
    local t0=$SECONDS
    timeout "$bound" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    {
        echo "== $name: rc=$rc in $((SECONDS - t0)) s"
        tail -n 30 "$logs/$name.log"
    } >>"$summary"
}

# 1. In-process recovery with the state on the GPU (issue 44): it has never run.
ELASTRUN_BENCH_DEVICE=$device step inprocess_state 240 \
    "$py" benchmarks/bench_inprocess_state.py "$profile" --output-dir "$out"
# 2. A memory checkpoint's save with the state on the GPU, 1.6 GB (issue 43: <= 0.2 s).
ELASTRUN_BENCH_DEVICE=$device step memory_checkpoint 150 \
    "$py" benchmarks/bench_memory_checkpoint.py "$profile" --output-dir "$out"
# 3. A group restart with NCCL, beside torchrun's.
ELASTRUN_BENCH_DEVICE=$device step gpu_recovery 150 \
    "$py" benchmarks/bench_gpu_recovery.py "$profile" --output-dir "$out"
rm -rf "$logs"
cat "$summary"
