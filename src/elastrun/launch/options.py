"""The ``elastrun`` option table: every option, its spellings, default, help and variable.

A new option is one more row here plus the code that reads it (see
:mod:`elastrun.launch.cli`). Every ``--dashed-option`` also gets its
``--underscore_option`` spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastrun.launch.config import DEFAULT_SIGNALS, START_METHODS

__all__ = ["BY_DEST", "EVENT_LOG_HANDLERS", "NUMA_BINDINGS", "OPTIONS", "Option", "option"]

EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous", "file:PATH")
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]
    help: str
    default: str | None = None
    flag: bool = False
    #: Whether torchrun reads a ``PET_<DEST>`` fallback for it.
    env: bool = True
    #: An elastrun addition (not a torchrun option).
    ours: bool = False
    metavar: str | None = None

    @property
    def canonical(self) -> str:
        """The first long spelling, used when no option string was typed."""
        return next(n for n in self.names if n.startswith("--"))

    @property
    def dest(self) -> str:
        return self.canonical[2:].replace("-", "_")

    @property
    def env_name(self) -> str:
        return f"PET_{self.dest.upper()}"


def option(
    name: str,
    metavar: str | None,
    help: str,
    default: str | None = None,
    *,
    short: str | None = None,
    env: bool = True,
    ours: bool = False,
) -> Option:
    """One table row; ``metavar=None`` makes a flag. Adds the underscore spelling."""
    under = "--" + name[2:].replace("-", "_")
    names = (*([short] if short else []), name, *([under] if under != name else []))
    return Option(names, help, default, metavar is None, env, ours, metavar)


OPTIONS: tuple[Option, ...] = (
    option("--nnodes", "N", "number of nodes: N, or MIN:MAX", "1:1"),
    option(
        "--nproc-per-node",
        "N",
        "workers per node: a positive integer, cpu, gpu or auto (GPUs if any, else CPUs)",
        "1",
    ),
    option(
        "--rdzv-backend",
        "NAME",
        "rendezvous backend: c10d, static, etcd (v3), or a registered plugin",
        "static",
    ),
    option("--rdzv-endpoint", "HOST[:PORT]", "rendezvous endpoint", ""),
    option("--rdzv-id", "ID", "run id shared by every node of the job", "none"),
    option("--rdzv-conf", "K=V,...", "extra rendezvous settings", ""),
    option(
        "--standalone",
        None,
        "run one node with its own rendezvous on a free local port; "
        "--rdzv-backend, --rdzv-endpoint and --rdzv-id are then ignored",
    ),
    option("--max-restarts", "N", "worker-group restarts allowed after failures", "0"),
    option("--monitor-interval", "SECONDS", "time between worker health checks", "0.1"),
    option(
        "--start-method",
        "METHOD",
        f"start method for function workers: {', '.join(START_METHODS)}",
        "spawn",
    ),
    option(
        "--event-log-handler",
        "NAME",
        f"destination of events: {', '.join(EVENT_LOG_HANDLERS)}",
        "null",
    ),
    option("--role", "ROLE", "role name of the workers (ROLE_NAME)", "default"),
    option("--module", None, "run the script as a module, like python -m", short="-m"),
    option("--no-python", None, "run the script as a program, without python"),
    option(
        "--run-path",
        None,
        "run the script with runpy.run_path in a child interpreter; "
        "takes precedence over -m and --no-python",
    ),
    option("--log-dir", "DIR", "base directory for worker logs (default: a temp dir)"),
    option(
        "--redirects",
        "SPEC",
        "streams written to log files: 0 none, 1 stdout, 2 stderr, 3 both; "
        "or per local rank, e.g. 0:3,1:1",
        "0",
        short="-r",
    ),
    option("--tee", "SPEC", "like --redirects, and also shown on the console", "0", short="-t"),
    option(
        "--local-ranks-filter",
        "RANKS",
        "local ranks whose output reaches the console, e.g. 0,1 (files are unaffected)",
        "",
    ),
    option(
        "--duplicate-stdout-filters",
        "TEXT,...",
        "tee'd stdout lines containing one of these are also written to "
        "filtered_stdout.log (,, is a literal comma)",
        "",
    ),
    option("--duplicate-stderr-filters", "TEXT,...", "the same for stderr", ""),
    option("--node-rank", "N", "this node's rank (static backend only)", "0"),
    option(
        "--master-addr",
        "HOST",
        "address of the rank-0 node (static backend only); IPv6 as [addr]",
        "127.0.0.1",
    ),
    option(
        "--master-port",
        "PORT",
        "port on the rank-0 node (static backend only; default 29500); "
        "giving it keeps a single node on the static backend",
    ),
    option("--local-addr", "HOST", "this node's address (default: the host's FQDN)"),
    option(
        "--logs-specs",
        "NAME",
        "log layout plugin: an entry point in elastrun.logs_specs or torchrun.logs_specs",
        env=False,
    ),
    option(
        "--numa-binding",
        "MODE",
        f"bind workers to CPUs near their GPU (or spread over NUMA nodes without GPUs): "
        f"{', '.join(NUMA_BINDINGS)}",
        env=False,
    ),
    option(
        "--signals-to-handle",
        "SIG,...",
        "signals the launcher traps to stop the workers",
        DEFAULT_SIGNALS,
    ),
    option(
        "--shutdown-timeout",
        "SECONDS",
        "time workers get to exit before SIGKILL "
        "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    ),
    option(
        "--stuck-exit-timeout",
        "SECONDS",
        "after every other local worker exited successfully, a worker still running this "
        "long gets its stacks dumped and is named in a warning (not stopped); 0 turns it "
        "off",
        "60",
        ours=True,
    ),
    option(
        "--stalled-restarts",
        "N",
        "stop restarting, exit status 93, after N restarts in a row in which no rank "
        "passed the step it had reached before (needs progress reports; 0 turns it off)",
        "3",
        ours=True,
    ),
    option(
        "--no-crash-loop-stop",
        None,
        "restart within --max-restarts even when a rank failed twice in a row with the "
        "same error at the same step (by default that stops the job, exit status 93)",
        ours=True,
    ),
    option(
        "--exclude-after",
        "K",
        "keep a node out of the rounds for --exclude-cooldown once its workers failed K "
        "times within --exclude-window (a spare takes its place; never below the --nnodes "
        "minimum); 0 turns it off, as torchrun",
        "0",
        ours=True,
    ),
    option(
        "--exclude-window",
        "SECONDS",
        "how long a node's failure counts towards --exclude-after",
        "600",
        ours=True,
    ),
    option(
        "--exclude-cooldown",
        "SECONDS",
        "how long an excluded node sits out before it joins again",
        "300",
        ours=True,
    ),
    option(
        "--exclude-exit",
        None,
        "an excluded node's agent exits with status 75 (replace this node) instead of "
        "waiting out --exclude-cooldown, for schedulers that replace nodes",
        ours=True,
    ),
    option(
        "--node-check",
        None,
        "check this node before it joins its first round and before it rejoins after a "
        "failure of its workers (a matrix product on each accelerator, a timed exchange "
        "with a partner node); a node that fails is kept out as by --exclude-after "
        "(never below the --nnodes minimum). Off by default, as torchrun",
        ours=True,
    ),
    option(
        "--node-check-timeout",
        "SECONDS",
        "how long a node's check may take; a node that overruns it failed",
        "120",
        ours=True,
    ),
    option(
        "--node-check-script",
        "PATH",
        "a check of your own, run after the built-in one on each checked node (a .py "
        "file with the workers' interpreter, else as a program); exit status 0: healthy",
        ours=True,
    ),
    option(
        "--node-check-slowdown",
        "K",
        "a node whose check is slower than K times the median of its peers' fails",
        "3",
        ours=True,
    ),
    option(
        "--hang-timeout",
        "SECONDS|auto",
        "a worker that reported progress (optimizer steps, elastrun.progress()) and then "
        "none for this long is hung: its stacks are dumped, it is killed and counts as a "
        "failure; auto derives the timeout from its step times (default: off)",
        ours=True,
    ),
    option(
        "--straggler-factor",
        "K|off",
        "a rank whose step time stays above K times the median of its peers' for 3 "
        "windows in a row is reported (a warning, an event, a metric; never stopped); "
        "nodes are compared the same way",
        "2",
        ours=True,
    ),
    option(
        "--straggler-window",
        "SECONDS",
        "the length of one straggler window (a straggler is reported after 3 in a row)",
        "10",
        ours=True,
    ),
    option("--virtual-local-rank", None, "give every worker LOCAL_RANK=0 and only its own GPU"),
    option(
        "--dry-run",
        None,
        "print the launch plan and exit without starting anything",
        env=False,
        ours=True,
    ),
    option(
        "--metrics-port",
        "PORT",
        "serve the agent's metrics at http://127.0.0.1:PORT/metrics (Prometheus text format)",
        ours=True,
    ),
    option(
        "--preload",
        "MOD,...",
        "modules the worker template imports once, before forking workers "
        "(default: torch when the script imports it)",
        "",
        ours=True,
    ),
    option(
        "--slurm",
        None,
        "inside srun, one elastrun per node: take the node count, run id, rendezvous "
        "endpoint (the first node), this node's address and rank from the Slurm step; "
        "options given explicitly win",
        ours=True,
    ),
    option(
        "--no-template",
        None,
        "start every Python worker as a fresh interpreter instead of forking it from "
        "the pre-imported template process",
        ours=True,
    ),
)
#: dest -> its option.
BY_DEST = {opt.dest: opt for opt in OPTIONS}
