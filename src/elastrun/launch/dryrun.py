"""``--dry-run``: print the launch plan of the first round; start nothing, write nothing.

The plan is the one the agent computes, through the agent's own constructors (the
config's ``worker_spec`` and ``agent_options``, ``WorkerServices.of``, ``round_plan``),
so the ``env`` line lists exactly the variables elastrun sets for the worker. A value
that exists only at run time (a port chosen per round, a temporary path, a generated run
id) is shown as ``<run time: ...>``.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from elastrun.agent.plan import (
    LaunchPlan,
    NodeSlot,
    RoundFacts,
    WorkerPlan,
    WorkerServices,
    round_plan,
)
from elastrun.agent.spec import Entrypoint
from elastrun.checkpoint.agent.capacity import capacity_lines
from elastrun.launch.cli import Launch
from elastrun.launch.config import LaunchConfig
from elastrun.supervise.processes.logs import Std, to_map
from elastrun.wire.env import SIGNALS_TO_HANDLE_ENV
from elastrun.wire.timer import file_timer_enabled

_PORT_PLACEHOLDER = 0


def _log_lines(launch: Launch, local_rank: int, nproc: int) -> list[str]:
    specs = launch.config.logs_specs
    if specs is None:
        return ["error file: <temporary log dir>/<run_id>_<random>/attempt_0/{lr}/error.json"]
    base = getattr(specs, "_log_dir", None) or "<new temporary dir>"
    redirects = to_map(specs.redirects, nproc)[local_rank]
    tee = to_map(specs.tee, nproc)[local_rank]
    where = f"{base}/<run_id>_<random>/attempt_0/{local_rank}"
    lines = []
    for bit, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
        if (redirects | tee) & bit:
            how = "file and console" if tee & bit else "file only"
            lines.append(f"{name}: {where}/{name}.log ({how})")
        else:
            shown = specs.local_ranks_filter is None or local_rank in specs.local_ranks_filter
            lines.append(f"{name}: {'console' if shown else 'discarded (--local-ranks-filter)'}")
    lines.append(f"error file: {where}/error.json")
    return lines


def _start_mode(launch: Launch, argv: tuple[str, ...] | None) -> str:
    """How the workers will be started: forked from the template, or fresh."""
    from elastrun.template.agent.starter import default_preload, parse_bootstrap_command

    if argv is None:
        return f"function workers ({launch.config.start_method})"
    if not launch.config.use_template:
        return "fresh interpreter per worker (--no-template)"
    if parse_bootstrap_command(argv, launch.python) is None:
        return "fresh process per worker (the template serves Python scripts and modules)"
    modules = list(dict.fromkeys([*launch.config.preload, *default_preload(argv)]))
    what = ", ".join(modules) if modules else "nothing yet"
    return (
        f"forked from a template process (preloading: {what}); a preloaded module that "
        "starts threads or initialises CUDA when imported would disable it, said once "
        "at the start; --no-template to disable"
    )


def render_plan(
    launch: Launch, entrypoint: Entrypoint, args: Sequence[object], environ: Mapping[str, str]
) -> str:
    """The plan as text: each worker's argv, the variables elastrun sets, its log paths."""
    cfg = launch.config
    run_id = cfg.run_id or "<run time: generated at start>"
    static = cfg.rdzv_backend == "static"
    master_addr = (cfg.master_addr or "127.0.0.1") if static else (cfg.local_addr or "127.0.0.1")
    facts = RoundFacts(
        run_id=run_id,
        round=0,
        group_rank=cfg.node_rank if static else 0,
        group_world_size=cfg.max_nodes,
        master_addr=master_addr,
        master_port=(cfg.master_port or 29500) if static else _PORT_PLACEHOLDER,
        restart_count=0,
        max_restarts=cfg.max_restarts,
        use_agent_store=True,  # the built-in backends: group rank 0's agent serves it
    )
    # (With the variable launch_agent sets in the launcher's own environment first.)
    options = cfg.agent_options({**environ, SIGNALS_TO_HANDLE_ENV: cfg.signals_to_handle})
    services = WorkerServices.of(options, file_timer=file_timer_enabled(options.environ))
    plan = round_plan(
        facts,
        cfg.worker_spec(None, entrypoint, args),
        [NodeSlot(cfg.role, cfg.nproc_per_node)] * cfg.max_nodes,
        base_env=options.environ,
        python=options.python,
        services=services,
    )
    checkpoints = capacity_lines(cfg.nproc_per_node, nodes=cfg.max_nodes)
    out = [
        "elastrun launch plan (dry run: nothing was started)",
        f"  run id      : {run_id}",
        f"  rendezvous  : {cfg.rdzv_backend}{_where(launch.standalone, cfg)}",
        f"  nodes       : {cfg.min_nodes}:{cfg.max_nodes}, {cfg.nproc_per_node} worker(s) per node",
        f"  restarts    : up to {cfg.max_restarts}; shutdown grace {cfg.shutdown_timeout:g}s",
        f"  start       : {_start_mode(launch, plan.workers[0].argv)}",
        f"  checkpoints : {checkpoints[0]}",  # (memory checkpoints, docs/checkpoints.md)
        *(f"                {line}" for line in checkpoints[1:]),
        *(f"  note        : {notice}" for notice in launch.notices),
    ]
    for w in plan.workers:
        out.extend(_worker_lines(launch, plan, w))
    return "\n".join(out)


def _worker_lines(launch: Launch, plan: LaunchPlan, w: WorkerPlan) -> list[str]:
    """One worker's part of the plan: its argv (or call), variables and log paths."""
    out = [f"worker local_rank={w.local_rank} rank={w.ranks.global_rank}:"]
    if w.argv is not None:
        out.append(f"  argv: {shlex.join(w.argv)}")
    else:
        name = getattr(plan.function, "__qualname__", repr(plan.function))
        out.append(f"  call: {name}{tuple(w.args)!r}")
    env = dict(w.env)
    if env.get("MASTER_PORT") == str(_PORT_PLACEHOLDER):
        env["MASTER_PORT"] = "<run time: a free port chosen each round>"
    env.update((name, value.placeholder) for name, value in w.runtime.items())
    out.append("  env : " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    out.extend(
        f"  {line}" for line in _log_lines(launch, w.local_rank, launch.config.nproc_per_node)
    )
    return out


def _where(standalone: bool, cfg: LaunchConfig) -> str:
    if standalone:
        return " (standalone, one node)"
    if not cfg.rdzv_endpoint.strip() and cfg.max_nodes == 1 and cfg.rdzv_backend == "c10d":
        return " (one node, no endpoint: no store is served)"
    return f" at {cfg.rdzv_endpoint}"
