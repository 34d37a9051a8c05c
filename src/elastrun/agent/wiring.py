"""What a ``LocalElasticAgent`` is made of: its options, its collaborators, the state
they share, and its public face (status, phase, liveness for the health check).

``AgentWiring`` builds the collaborators the loop delegates to -- ``WorkerProcesses``
(agent.workers), ``Rounds`` (agent.rounds), the in-process recovery
(agent.inprocess, agent.inprocess_steps), ``AttemptWatches`` (agent.watches), the
progress and pace watches and ``AgentReport`` -- and holds the few steps they all use:
entering a phase, moving the worker group's state, stopping the current attempt,
and ending a wait when a signal arrives. The elastic loop itself is
``LocalElasticAgent``'s (agent.local).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import TypeVar

from elastrun.agent.attempt import Attempt
from elastrun.agent.inprocess import InprocessRecovery, inprocess_timeout, join_timeout
from elastrun.agent.inprocess_steps import InprocessSteps
from elastrun.agent.interrupt import run_interruptibly
from elastrun.agent.pace_watch import PaceWatch
from elastrun.agent.phases import WORKER_TRANSITIONS, AgentPhase, PhaseMachine
from elastrun.agent.plan import (
    INPROCESS_ENV,
    SIGNALS_TO_HANDLE_ENV,
    LaunchPlan,
    WorkerServices,
)
from elastrun.agent.policy import RestartAll, RestartBudget, RestartPolicy, default_budget
from elastrun.agent.progress_watch import ProgressWatch
from elastrun.agent.report import AgentReport
from elastrun.agent.rounds import Rounds
from elastrun.agent.spec import WorkerGroup, WorkerSpec, WorkerState
from elastrun.agent.watches import STUCK_EXIT_TIMEOUT, AttemptWatches, FileTimer
from elastrun.agent.workers import Guard, WorkerProcesses
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.observe.sinks import EventSink, EventValue, MetricSink, NullEventSink, NullMetricSink
from elastrun.rendezvous.api import RendezvousHandler
from elastrun.rendezvous.elastic import as_elastic
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.supervise.processes.dstate import UninterruptibleWatch
from elastrun.supervise.processes.guard import OrphanGuard
from elastrun.supervise.processes.logs import DefaultLogsSpecs, LogsSpecs
from elastrun.supervise.processes.relay import PYTHON_CONSOLE, Console
from elastrun.supervise.processes.spawn import ProcessStarter
from elastrun.supervise.progress import AutoTimeout, StragglerSettings

log = logging.getLogger("elastrun.agent")

T = TypeVar("T")


class AgentWiring:
    """The parts of a ``LocalElasticAgent`` and the steps they share (its arguments
    are documented there)."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs | None = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: float = 30,
        health_check_server: object | None = None,
        *,
        run_id: str | None = None,
        shutdown: ShutdownRequest | None = None,
        starter: ProcessStarter | None = None,
        policy: RestartPolicy | None = None,
        budget: RestartBudget | None = None,
        clock: Clock = SYSTEM_CLOCK,
        environ: Mapping[str, str] | None = None,
        python: str = sys.executable,
        events: EventSink | None = None,
        hostname: str | None = None,
        guard: Guard | None = None,
        metrics: MetricSink | None = None,
        file_timer: FileTimer | None = None,
        stuck_watch: UninterruptibleWatch | None = None,
        stuck_exit_timeout: float | None = STUCK_EXIT_TIMEOUT,
        hang_timeout: float | AutoTimeout | None = None,
        stalled_restarts: int | None = 3,
        stragglers: StragglerSettings | None = StragglerSettings(),  # noqa: B008 (frozen)
        console: Console = PYTHON_CONSOLE,
    ) -> None:
        self._spec = spec
        self._logs = logs_specs if logs_specs is not None else DefaultLogsSpecs()
        self._exit_barrier_timeout = exit_barrier_timeout
        self._shutdown_timeout = shutdown_timeout
        self._owns_shutdown = shutdown is None
        self._shutdown = shutdown if shutdown is not None else ShutdownRequest()
        self._rendezvous_parts(run_id, policy, budget)
        self._clock = clock
        self._environ = dict(os.environ if environ is None else environ)
        self._python = python
        self._events = events if events is not None else NullEventSink()
        self._metrics = metrics if metrics is not None else NullMetricSink()
        self._file_timer = file_timer
        self._watch_parts(hang_timeout, stalled_restarts, stragglers)
        self._host = hostname or socket.getfqdn()
        self._group = WorkerGroup(spec)
        self._attempt: Attempt | None = None
        self._attempts = 0
        self._guard: Guard = guard if guard is not None else OrphanGuard(python)
        self._compose(
            start_method=start_method,
            prefix_template=log_line_prefix_template,
            console=console,
            starter=starter,
            stuck_watch=stuck_watch,
            stuck_exit_timeout=stuck_exit_timeout,
        )
        self.history: list[str] = []  # one line per failure that caused a restart
        self.budget_note: str | None = None

    def _rendezvous_parts(
        self, run_id: str | None, policy: RestartPolicy | None, budget: RestartBudget | None
    ) -> None:
        """The rendezvous handler (a standalone one when the spec has none), what the
        agent needs of it beyond torch's methods, the restart policy and budget."""
        self._handler: RendezvousHandler = self._spec.rdzv_handler or LocalRendezvousHandler(
            run_id or str(uuid.uuid4())
        )
        self._rdzv = as_elastic(self._handler)
        self._policy = policy if policy is not None else RestartAll()
        self._budget = (
            budget if budget is not None else default_budget(self._rdzv, self._spec.max_restarts)
        )

    def _watch_parts(
        self,
        hang_timeout: float | AutoTimeout | None,
        stalled_restarts: int | None,
        stragglers: StragglerSettings | None,
    ) -> None:
        """What watches and reports the workers' progress, and the agent's phases."""
        # Where workers report progress (shared memory, no store round trip), and the
        # verdicts read from it.
        self._progress = ProgressWatch(
            self._spec.local_world_size, hang_timeout, stalled_restarts or None, self._clock
        )
        self._pace = PaceWatch(stragglers, self._events, self._metrics, self._clock)
        self._report = AgentReport(self._events, self._metrics, self._budget)
        #: Why restarting stopped because the restarts made no progress (else None).
        self.stalled: str | None = None
        self._phases = PhaseMachine(self._on_phase)
        #: Wall-clock time of the loop's last pass (the health check's "last progress").
        self.last_progress = self._clock.time()

    def _compose(
        self,
        *,
        start_method: str,
        prefix_template: str | None,
        console: Console,
        starter: ProcessStarter | None,
        stuck_watch: UninterruptibleWatch | None,
        stuck_exit_timeout: float | None,
    ) -> None:
        """The collaborators the loop delegates to: the worker processes, the rounds
        and the watches."""
        self._workers = WorkerProcesses(
            self._spec,
            self._group,
            self._logs,
            start_method=start_method,
            prefix_template=prefix_template,
            console=console,
            starter=starter,
            environ=self._environ,
            python=self._python,
            guard=self._guard,
            file_timer=self._file_timer,
            progress=self._progress,
            shutdown=self._shutdown,
            shutdown_timeout=self._shutdown_timeout,
            clock=self._clock,
            metrics=self._metrics,
        )
        self._rounds = Rounds(
            self._handler,
            self._spec,
            self._group,
            budget=self._budget,
            environ=self._environ,
            python=self._python,
            services=WorkerServices(
                file_timer=self._file_timer is not None,
                inprocess=self._environ.get(INPROCESS_ENV, "1") != "0",
                # Set by the launcher in its own environment, as torchrun does.
                signals_to_handle=self._environ.get(SIGNALS_TO_HANDLE_ENV),
            ),
            pace=self._pace,
            report=self._report,
            interruptible=self.interruptible,
            clock=self._clock,
        )
        self._compose_watches(stuck_watch, stuck_exit_timeout)

    def _compose_watches(
        self, stuck_watch: UninterruptibleWatch | None, stuck_exit_timeout: float | None
    ) -> None:
        """The in-process recovery and the running attempt's watches."""
        self._inprocess = InprocessRecovery(
            workers=self._workers,
            store=self._rounds.bootstrap_store,
            events=self._events,
            metrics=self._metrics,
            clock=self._clock,
            wake=self._shutdown.waker.wake,
            timeout=inprocess_timeout(self._environ, self._progress.hang_timeout),
            join_timeout=join_timeout(self._environ),
        )
        self._steps = InprocessSteps(
            self._inprocess, self._rounds, self._group, self._budget, self._pace, self
        )
        self._watches = AttemptWatches(
            self._progress,
            stuck=stuck_watch,
            file_timer=self._file_timer,
            stuck_exit_timeout=stuck_exit_timeout,
            events=self._events,
            clock=self._clock,
        )

    # -- public API ------------------------------------------------------------------

    @property
    def rdzv_handler(self) -> RendezvousHandler:
        return self._handler

    @property
    def logs_specs(self) -> LogsSpecs:
        return self._logs

    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        return self._group

    def alive(self) -> float:
        """The last sign of progress (for the health check): the file timer's, if any."""
        if self._file_timer is not None:
            return max(self.last_progress, self._file_timer.get_last_progress_time())
        return self.last_progress

    @property
    def phase(self) -> AgentPhase:
        """What the agent is doing now (rendezvous, running, exit barrier...)."""
        return self._phases.phase

    def status(self) -> dict[str, object]:
        """A snapshot for the health check and status views."""
        g = self._group
        return {
            "state": g.state.value,
            "phase": self._phases.phase.value,
            "run_id": self._handler.get_run_id(),
            "attempt": self._attempts - 1,
            "restart_count": self._budget.used,
            "max_restarts": self._budget.limit,
            "group_rank": g.group_rank,
            "group_world_size": g.group_world_size,
            "workers": [w.id for w in g.workers],
            "progress": self._progress.status(),
        }

    def move(self, phase: AgentPhase) -> None:
        """Enter ``phase`` (for ``InprocessSteps``)."""
        self._phases.move(phase)

    def restart_group(self, plan: LaunchPlan | None) -> None:
        """Stop the workers and start them afresh (the loop's; for ``InprocessSteps``)."""
        raise NotImplementedError

    def _check_shutdown(self) -> None:
        signum = self._shutdown.signum
        if signum is None:
            return
        name = signal.Signals(signum).name
        if self._attempt is not None:
            log.warning("received %s: stopping workers (grace %.0fs)", name, self._shutdown_timeout)
            self._finish_attempt(signum)
        self._events.record("agent.signal", {"signal": name})
        raise ShutdownRequested(signum)

    def interruptible(self, call: Callable[[], T], what: str) -> T:
        """``call()``, ended by a signal (see ``agent.interrupt``)."""

        def on_signal() -> None:
            log.info("stopped while waiting for the %s", what)
            self._check_shutdown()

        observes = self._rdzv.observes_cancel_scope
        return run_interruptibly(
            call, self._shutdown, on_signal, what, observes_cancel_scope=observes
        )

    def _finish_attempt(self, sig: int) -> None:
        """Stop whatever still runs of the current attempt and drain its output."""
        if self._attempt is not None:
            self._workers.stop(self._attempt, sig)

    # -- phases and states ---------------------------------------------------------------

    def _on_phase(self, old: AgentPhase, new: AgentPhase) -> None:
        log.debug("agent phase %s -> %s", old.value, new.value)
        self._events.record("agent.phase", {"from": old.value, "to": new.value})

    def _transition(self, new: WorkerState) -> None:
        old = self._group.state
        if new not in WORKER_TRANSITIONS[old]:
            raise RuntimeError(f"illegal worker-group transition {old.value} -> {new.value}")
        self._group.state = new
        self._metrics.put(f"agent.state.{new.value}", 1)  # the one-hot state gauge
        meta: dict[str, EventValue] = {"from": old.value, "to": new.value}
        self._events.record("agent.state", meta)
