#!/usr/bin/env bash
# Several elastrun agents on this one machine, as if each were a node of a cluster: they
# meet at one rendezvous endpoint (the first agent serves the store) and form one world.
#
# usage: examples/multinode_local.sh [-n NODES] [-m MIN_NODES] [-p NPROC_PER_NODE]
#                                    [--port PORT] [--max-restarts N] SCRIPT [ARGS...]
#   -n NODES           agents to start (default 2); --nnodes is MIN_NODES:NODES
#   -m MIN_NODES       the fewest nodes the job runs with (default NODES)
#   -p NPROC_PER_NODE  workers per agent (default 1)
#   --port PORT        rendezvous port on 127.0.0.1 (default: a free one)
# Environment: ELASTRUN (default "elastrun") is the launcher command, e.g.
# "python -m elastrun"; PYTHON (default python3) picks the free port.
#
# Each agent's output is prefixed with [node I]. The script waits for every agent and
# exits 0 only if all succeeded; on Ctrl-C or SIGTERM it stops the agents it started
# (their workers die with them) and nothing else.
set -euo pipefail

nodes=2 min="" nproc=1 port="" max_restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) nodes="$2"; shift 2 ;;
    -m) min="$2"; shift 2 ;;
    -p) nproc="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "multinode_local.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "multinode_local.sh: no script given (see --help)" >&2
  exit 2
fi
min="${min:-$nodes}"
read -r -a elastrun <<< "${ELASTRUN:-elastrun}"
if [[ -z "$port" ]]; then
  port="$("${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
run_id="local-$$"

pids=()
stop() {
  # Only the agents this script started; each takes its workers down with it.
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap 'stop; wait; exit 130' INT
trap 'stop; wait; exit 143' TERM

echo "multinode_local.sh: $nodes agent(s) x $nproc worker(s), --nnodes $min:$nodes, rendezvous 127.0.0.1:$port, run id $run_id"
for ((i = 0; i < nodes; i++)); do
  "${elastrun[@]}" --nnodes "$min:$nodes" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "$run_id" \
    --local-addr 127.0.0.1 --max-restarts "$max_restarts" "$@" \
    > >(sed -u "s/^/[node $i] /") 2>&1 &
  pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
  code=0
  wait "$pid" || code=$?
  if [[ $code -ne 0 && $status -eq 0 ]]; then status=$code; fi
done
wait  # the output filters
exit "$status"
