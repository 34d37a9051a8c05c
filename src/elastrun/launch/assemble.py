"""The composition root: how an agent is assembled from its options and the world.

``assemble`` builds the parts the loop (agent.loop) works with (``AgentParts``), once,
from the frozen ``AgentOptions`` and the injected ``World`` (production defaults where a
field is None); the settings the parts read are taken from the options here, once, into
frozen values (``WorkerInterpreter``, ``WorkerSettings``, ``RecoveryBounds``). The
parts know nothing of the loop: none is handed it, and none calls back into it.

It lives in the launch layer, above the agent and the recovery strategies it composes
(in-process recovery's agent side uses the agent's parts), so that neither imports the
other's folder back.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable

from elastrun.agent.cooldown import CoolDown
from elastrun.agent.ladder import Ladder, Rung
from elastrun.agent.notices import Notices
from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import AgentParts, World
from elastrun.agent.phases import Lifecycle
from elastrun.agent.plan import LaunchPlan, WorkerServices
from elastrun.agent.planner import RoundPlanner
from elastrun.agent.policy import RestartBudget, default_budget
from elastrun.agent.report import AgentReport
from elastrun.agent.rounds import Rounds
from elastrun.agent.rungs import BudgetRung, CrashLoopRung, GroupRestartRung, StallRung
from elastrun.agent.setups import AttemptSetups, WorkerSettings
from elastrun.agent.spec import WorkerGroup, WorkerSpec
from elastrun.agent.watches import AttemptWatches
from elastrun.agent.workers import Guard, WorkerProcesses
from elastrun.checkpoint.agent.buddy import NodeCopies
from elastrun.checkpoint.agent.node_dir import NodeCheckpointDir
from elastrun.checkpoint.agent.reports import CheckpointReports
from elastrun.core.clock import Clock
from elastrun.core.interrupt import Interruptible
from elastrun.core.shutdown import ShutdownRequest
from elastrun.inprocess.agent.bounds import RecoveryBounds
from elastrun.inprocess.agent.recovery import InprocessRecovery
from elastrun.inprocess.agent.rung import InPlaceRung
from elastrun.inprocess.agent.steps import InprocessSteps
from elastrun.nodecheck.agent.check import NodeCheck
from elastrun.observe.sinks import EventSink, MetricSink, NullEventSink, NullMetricSink
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.pace.agent.step_watch import PaceWatch
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo
from elastrun.rendezvous.elastic import ElasticRendezvous, as_elastic
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.supervise.processes.guard import OrphanGuard
from elastrun.supervise.processes.interpreter import WorkerInterpreter
from elastrun.supervise.processes.logs import DefaultLogsSpecs, LogsSpecs

__all__ = ["assemble"]


def assemble(spec: WorkerSpec, options: AgentOptions, world: World) -> AgentParts:
    """The parts of an agent that runs ``spec`` (no I/O: nothing starts here)."""
    handler = spec.rdzv_handler or LocalRendezvousHandler(options.run_id or str(uuid.uuid4()))
    rdzv = as_elastic(handler)
    shutdown = world.shutdown if world.shutdown is not None else ShutdownRequest()
    budget = world.budget or default_budget(rdzv.outcome, spec.max_restarts)
    events = world.events if world.events is not None else NullEventSink()
    metrics = world.metrics if world.metrics is not None else NullMetricSink()
    group = WorkerGroup(spec)
    progress = ProgressWatch(
        spec.local_world_size, options.hang_timeout, options.stalled_restarts or None, world.clock
    )
    pace = PaceWatch(options.stragglers, events, metrics, world.clock)
    report = AgentReport(events, metrics, budget)
    interruptible = Interruptible(shutdown)
    host = options.hostname or socket.getfqdn()
    logs = world.logs if world.logs is not None else DefaultLogsSpecs()
    interpreter = WorkerInterpreter(options.python, options.environ)
    guard: Guard = world.guard or OrphanGuard(options.python, options.environ)
    workers = _workers(group, logs, options, world, interpreter, guard, progress, shutdown, metrics)
    checkpoints = world.checkpoints or NodeCheckpointDir(on_made=guard.remove_if_orphaned)
    checkpoint_reports = CheckpointReports(lambda: checkpoints.path, events, metrics, world.clock)
    services = WorkerServices.of(options, file_timer=world.file_timer is not None)
    rounds = Rounds(
        handler, rdzv, RoundPlanner(handler, group, budget, interpreter, services), pace=pace,
        report=report, interruptible=interruptible, clock=world.clock,
        on_round=[_round_part(NodeCopies(checkpoints, rdzv.store_seat, events, metrics))],
    )  # fmt: skip
    notices = Notices()
    inprocess = _inprocess(
        workers, rounds, options, world.clock, events, metrics, notices, rdzv.loss_bound
    )
    nodecheck = NodeCheck(
        rdzv, options.node_check, interpreter=interpreter, interruptible=interruptible,
        events=events, metrics=metrics, clock=world.clock, host=host,
    )  # fmt: skip
    ladder = _ladder(
        options, inprocess, handler, rdzv,
        steps=InprocessSteps(inprocess, rounds, group, budget, pace, interruptible),
        progress=progress, budget=budget, interruptible=interruptible, events=events,
        group_restart=GroupRestartRung(nodecheck, checkpoint_reports),
    )  # fmt: skip
    watches = AttemptWatches(
        progress, stuck=world.stuck_watch, file_timer=world.file_timer,
        stuck_exit_timeout=options.stuck_exit_timeout, events=events, clock=world.clock,
    )  # fmt: skip
    cooldown = CoolDown(
        rdzv.exclusions, options.exclusion, interruptible=interruptible, events=events,
        metrics=metrics, clock=world.clock, node_check=options.node_check.enabled,
    )  # fmt: skip
    return AgentParts(
        spec=spec, options=options, logs=logs, group=group, handler=handler, rdzv=rdzv,
        shutdown=shutdown, owns_shutdown=world.shutdown is None, notices=notices,
        budget=budget, clock=world.clock, events=events, metrics=metrics, guard=guard,
        file_timer=world.file_timer, host=host, lifecycle=Lifecycle(group, events, metrics),
        interruptible=interruptible, progress=progress, pace=pace, report=report,
        workers=workers, rounds=rounds, ladder=ladder, watches=watches,
        cooldown=cooldown, nodecheck=nodecheck, checkpoints=checkpoints,
        checkpoint_reports=checkpoint_reports,
    )  # fmt: skip


def _ladder(
    options: AgentOptions,
    inprocess: InprocessRecovery,
    handler: RendezvousHandler,
    rdzv: ElasticRendezvous,
    *,
    steps: InprocessSteps,
    progress: ProgressWatch,
    budget: RestartBudget,
    interruptible: Interruptible,
    events: EventSink,
    group_restart: GroupRestartRung,
) -> Ladder:
    """The recovery ladder: the rules that end the run first (no recovery overrides
    them), then the cheapest recovery that can take the failure (see agent.ladder),
    the in-place rung following the workers between failures."""
    in_place = InPlaceRung(
        inprocess,
        steps,
        progress,
        lambda: handler.num_nodes_waiting() > 0,
        enabled=options.inprocess,
    )
    crash_loop = CrashLoopRung(progress, budget, rdzv.outcome, interruptible, events)
    rungs: list[Rung] = [
        StallRung(progress, events),
        *([crash_loop] if options.crash_loop_stop else []),
        BudgetRung(budget, interruptible),
        in_place,
        group_restart,
    ]
    return Ladder(rungs, in_place)


def _round_part(copies: NodeCopies) -> Callable[[RendezvousInfo, LaunchPlan], None]:
    """The memory checkpoints' copies told of each round: the global ranks of this
    node's workers and the world's size (the plan's)."""

    def start_round(info: RendezvousInfo, plan: LaunchPlan) -> None:
        ranks = [w.ranks.global_rank for w in plan.workers]
        world = plan.workers[0].ranks.world_size if plan.workers else 0
        copies.start_round(info, ranks, world)

    return start_round


def _workers(
    group: WorkerGroup,
    logs: LogsSpecs,
    options: AgentOptions,
    world: World,
    interpreter: WorkerInterpreter,
    guard: Guard,
    progress: ProgressWatch,
    shutdown: ShutdownRequest,
    metrics: MetricSink,
) -> WorkerProcesses:
    """What starts and stops each attempt's worker processes, and what they are started
    from."""
    settings = WorkerSettings(
        interpreter, options.start_method, prefix_template=options.log_line_prefix_template
    )
    setups = AttemptSetups(
        group.spec, settings, logs, world.console, world.starter, world.file_timer, progress
    )
    return WorkerProcesses(
        group,
        setups,
        guard=guard,
        shutdown=shutdown,
        shutdown_timeout=options.shutdown_timeout,
        clock=world.clock,
        metrics=metrics,
    )


def _inprocess(
    workers: WorkerProcesses,
    rounds: Rounds,
    options: AgentOptions,
    clock: Clock,
    events: EventSink,
    metrics: MetricSink,
    notices: Notices,
    loss_bound: float,
) -> InprocessRecovery:
    """The in-process recovery: replacements started by ``workers``, the workers' store
    of ``rounds`` re-hosted per in-process round (``loss_bound``: the rendezvous')."""
    bounds = RecoveryBounds(
        timeout=options.inprocess_timeout,
        join_timeout=options.inprocess_join_timeout,
        loss_bound=loss_bound,
    )
    return InprocessRecovery(
        workers=workers,
        store=rounds.bootstrap_store,
        events=events,
        metrics=metrics,
        clock=clock,
        wake=notices.post,  # (the hub wakes the loop on every worker message)
        bounds=bounds,
    )
