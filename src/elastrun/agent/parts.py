"""What an agent is made of: the world it is given (``World``) and the parts it is
assembled from (``AgentParts``, built once by ``launch.assemble``; the loop holds them).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastrun.agent.cooldown import CoolDown
from elastrun.agent.ladder import Ladder
from elastrun.agent.notices import Notices
from elastrun.agent.options import AgentOptions
from elastrun.agent.phases import Lifecycle
from elastrun.agent.policy import RestartBudget
from elastrun.agent.report import AgentReport
from elastrun.agent.rounds import Rounds
from elastrun.agent.spec import WorkerGroup, WorkerSpec
from elastrun.agent.watches import AttemptWatches, FileTimer
from elastrun.agent.workers import Guard, WorkerProcesses
from elastrun.checkpoint.agent.node_dir import NodeCheckpointDir
from elastrun.checkpoint.agent.reports import CheckpointReports
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.interrupt import Interruptible
from elastrun.core.shutdown import ShutdownRequest
from elastrun.nodecheck.agent.check import NodeCheck
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.pace.agent.step_watch import PaceWatch
from elastrun.rendezvous.api import RendezvousHandler
from elastrun.rendezvous.elastic import ElasticRendezvous
from elastrun.supervise.processes.dstate import UninterruptibleWatch
from elastrun.supervise.processes.logs import LogsSpecs
from elastrun.supervise.processes.relay import PYTHON_CONSOLE, Console
from elastrun.supervise.processes.spawn import ProcessStarter

__all__ = ["AgentParts", "World"]


@dataclass(frozen=True)
class World:
    """What an agent is given rather than builds: each None is a production default.

    Attributes:
        logs: where worker output and error files go (None: a temporary directory).
        shutdown: the request the launcher's signal handlers set (None: the agent's own).
        starter: starts the worker processes (None: chosen per plan).
        budget: the restart budget (None: job-wide when the rendezvous keeps one in its
            store, else this agent's own, of ``spec.max_restarts``).
        clock: the agent's.
        events, metrics: where the agent's events and metrics go (None: nowhere).
        guard: ends the workers when the agent dies (None: the orphan guard).
        file_timer: the expiration-timer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1).
        stuck_watch: ends the run when a worker stays in uninterruptible sleep.
        console: where tee'd lines are shown: ``sys.stdout``/``sys.stderr`` as they are
            at each start of the workers (torch's behaviour, so ``redirect_stdout`` or a
            notebook cell sees them) by default; the CLI passes ``FD_CONSOLE``.
        checkpoints: the node's memory checkpoint directory (None: one in /dev/shm).
    """

    logs: LogsSpecs | None = None
    shutdown: ShutdownRequest | None = None
    starter: ProcessStarter | None = None
    budget: RestartBudget | None = None
    clock: Clock = SYSTEM_CLOCK
    events: EventSink | None = None
    metrics: MetricSink | None = None
    guard: Guard | None = None
    file_timer: FileTimer | None = None
    stuck_watch: UninterruptibleWatch | None = None
    console: Console = PYTHON_CONSOLE
    checkpoints: NodeCheckpointDir | None = None


@dataclass(frozen=True)
class AgentParts:
    """The parts of one agent, assembled once (``assemble``); the loop holds them."""

    spec: WorkerSpec
    options: AgentOptions
    logs: LogsSpecs
    group: WorkerGroup
    handler: RendezvousHandler
    rdzv: ElasticRendezvous
    shutdown: ShutdownRequest
    owns_shutdown: bool  # the agent made ``shutdown`` (and closes it)
    notices: Notices  # "look again" for the loop's wait (rendezvous news, hub messages)
    budget: RestartBudget
    clock: Clock
    events: EventSink
    metrics: MetricSink
    guard: Guard
    file_timer: FileTimer | None
    host: str
    lifecycle: Lifecycle
    interruptible: Interruptible
    progress: ProgressWatch
    pace: PaceWatch
    report: AgentReport
    workers: WorkerProcesses
    rounds: Rounds
    ladder: Ladder
    watches: AttemptWatches
    cooldown: CoolDown
    nodecheck: NodeCheck
    checkpoints: NodeCheckpointDir  # the node's memory checkpoints, which outlive workers
    checkpoint_reports: CheckpointReports  # what the workers say of them: events, metrics
