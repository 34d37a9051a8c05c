"""``LocalElasticAgent``: the elastic loop of one node.

rendezvous -> plan -> start -> watch -> restart / finish. The loop blocks on events
(a worker exit through its pidfd, a signal through the shutdown waker) and checks the
rendezvous for waiting nodes at most every ``monitor_interval``; nothing sleeps a fixed
time on the recovery path.

The loop and the phase transitions live here; the work is done by collaborators:
``Rounds`` (agent.rounds) joins each round and plans it, ``WorkerProcesses``
(agent.workers) starts and stops each attempt's processes, ``AttemptWatches``
(agent.watches) watches the running workers, ``AgentReport`` (agent.report) logs,
counts and records each step; agent.failures and agent.finish word the failures and
read the round's outcome.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import TypeVar

from elastrun.agent import failures
from elastrun.agent.attempt import Attempt
from elastrun.agent.finish import BarrierAction, barrier_action, return_values
from elastrun.agent.inprocess import (
    INPROCESS_ENV,
    InprocessRecovery,
    inprocess_timeout,
    join_timeout,
)
from elastrun.agent.inprocess_steps import InprocessSteps
from elastrun.agent.interrupt import run_interruptibly
from elastrun.agent.pace_watch import PaceWatch
from elastrun.agent.phases import WORKER_TRANSITIONS, AgentPhase, PhaseMachine
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.policy import (
    Decision,
    RestartAll,
    RestartBudget,
    RestartPolicy,
    default_budget,
)
from elastrun.agent.progress_watch import ProgressWatch
from elastrun.agent.report import AgentReport
from elastrun.agent.rounds import Rounds
from elastrun.agent.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState
from elastrun.agent.watches import STUCK_EXIT_TIMEOUT, AttemptWatches, FileTimer
from elastrun.agent.workers import Guard, WorkerProcesses
from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.observe.sinks import EventSink, EventValue, MetricSink, NullEventSink, NullMetricSink
from elastrun.rendezvous.api import BarrierResult, RendezvousHandler
from elastrun.rendezvous.elastic import as_elastic
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.supervise.processes.dstate import UninterruptibleWatch
from elastrun.supervise.processes.guard import OrphanGuard
from elastrun.supervise.processes.logs import DefaultLogsSpecs, LogsSpecs
from elastrun.supervise.processes.procset import Exit
from elastrun.supervise.processes.spawn import ProcessStarter
from elastrun.supervise.progress import AutoTimeout, StragglerSettings

__all__ = ["STUCK_EXIT_TIMEOUT", "FileTimer", "Guard", "LocalElasticAgent"]

log = logging.getLogger("elastrun.agent")

T = TypeVar("T")


class LocalElasticAgent:
    """Runs, watches and restarts the workers of one node.

    Args:
        spec: what to run. ``spec.rdzv_handler`` None means a single standalone node.
        logs_specs: where worker output and error files go (default: a temporary dir).
        start_method: for function workers: ``spawn`` (fresh interpreter; the default,
            ``forkserver`` behaves the same) or ``fork``.
        exit_barrier_timeout: how long a finished node waits for its peers.
        log_line_prefix_template: template for tee'd lines (``${role_name}``,
            ``${rank}``, ``${local_rank}``).
        shutdown_timeout: grace between the stop signal and SIGKILL, for restarts and
            the final stop alike.
        run_id: the run id when ``spec.rdzv_handler`` is None.
        shutdown: a request set by the launcher's signal handlers.
        metrics: where the agent's metrics go.
        file_timer: the expiration-timer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1).
        stuck_watch: ends the run when a worker stays in uninterruptible sleep.
        hang_timeout: seconds without progress after which a worker that reported
            progress is hung (``AutoTimeout``: derived from its step times); its stacks
            are dumped, then it is killed and counts as a failure. None: off.
        stalled_restarts: stop restarting (``stalled`` is then set) after
            this many consecutive attempts in which no rank passed the step it had
            reached before; None turns it off. Scripts that report no progress are
            never stopped by it.
        stragglers: how ranks (and nodes) slower than their peers are found and
            reported (never stopped); None: off (step metrics are still put).
        stuck_exit_timeout: seconds a worker may keep running after every other local
            worker exited successfully before its stacks are dumped and a warning
            names it (it is not stopped); None turns the check off.
        starter, policy, budget, clock, environ, python, events, guard: injected
            collaborators (production defaults when None).
    """

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
    ) -> None:
        self._spec = spec
        self._logs = logs_specs if logs_specs is not None else DefaultLogsSpecs()
        self._exit_barrier_timeout = exit_barrier_timeout
        self._shutdown_timeout = shutdown_timeout
        self._handler: RendezvousHandler = spec.rdzv_handler or LocalRendezvousHandler(
            run_id or str(uuid.uuid4())
        )
        self._owns_shutdown = shutdown is None
        self._shutdown = shutdown if shutdown is not None else ShutdownRequest()
        self._policy = policy if policy is not None else RestartAll()
        self._rdzv = as_elastic(self._handler)  # what the agent needs beyond torch's methods
        self._budget = (
            budget if budget is not None else default_budget(self._rdzv, spec.max_restarts)
        )
        self._clock = clock
        self._environ = dict(os.environ if environ is None else environ)
        self._python = python
        self._events = events if events is not None else NullEventSink()
        self._metrics = metrics if metrics is not None else NullMetricSink()
        self._file_timer = file_timer
        # Where workers report progress (shared memory, no store round trip), and the
        # verdicts read from it.
        self._progress = ProgressWatch(
            spec.local_world_size, hang_timeout, stalled_restarts or None, clock
        )
        self._pace = PaceWatch(stragglers, self._events, self._metrics, clock)
        self._report = AgentReport(self._events, self._metrics, self._budget)
        #: Why restarting stopped because the restarts made no progress (else None).
        self.stalled: str | None = None
        self._phases = PhaseMachine(self._on_phase)
        #: Wall-clock time of the loop's last pass (the health check's "last progress").
        self.last_progress = clock.time()
        self._host = hostname or socket.getfqdn()
        self._group = WorkerGroup(spec)
        self._attempt: Attempt | None = None
        self._attempts = 0
        self._guard: Guard = guard if guard is not None else OrphanGuard(python)
        self._compose(
            start_method=start_method,
            prefix_template=log_line_prefix_template,
            starter=starter,
            stuck_watch=stuck_watch,
            stuck_exit_timeout=stuck_exit_timeout,
        )
        self.history: list[str] = []  # one line per failure that caused a restart
        self.budget_note: str | None = None

    def _compose(
        self,
        *,
        start_method: str,
        prefix_template: str | None,
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
            pace=self._pace,
            report=self._report,
            interruptible=self.interruptible,
            clock=self._clock,
        )
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

    def run(self, role: str = "default") -> RunResult:
        """Run the workers to completion, restarting them on failure.

        Returns the result (``FAILED`` with the failures when the restart budget ran
        out). Raises ``ShutdownRequested`` after stopping the workers on a signal.
        """
        try:
            return self._invoke_run()
        finally:
            self._phases.move(AgentPhase.DONE)
            self._rdzv.set_change_callback(lambda: None)  # its threads may outlive the waker
            self._finish_attempt(signal.SIGTERM)
            self._rounds.end()
            self._inprocess.close()
            self._shutdown.stop_relay()
            self._pace.close()
            self._progress.close()
            self._guard.close()
            if self._file_timer is not None:
                self._file_timer.stop()
            if self._owns_shutdown:
                self._shutdown.waker.close()
            self._workers.close()

    # -- the loop ----------------------------------------------------------------------

    def _invoke_run(self) -> RunResult:
        self._shutdown.start_relay()
        self._rdzv.set_node_info(self._spec.role, self._spec.local_world_size)
        # Membership news from the rendezvous' watch thread wakes the loop at once.
        self._rdzv.set_change_callback(self._shutdown.waker.wake)
        self._guard.start()
        if self._environ.get(INPROCESS_ENV, "1") != "0":
            self._inprocess.open(self._environ)  # its socket's path goes to every worker
        self._check_shutdown()
        self._start_round()
        while True:
            attempt = self._attempt
            assert attempt is not None
            attempt.procs.wait_for_exits(Deadline.after(self._spec.monitor_interval, self._clock))
            result = self._pass(attempt)
            if result is not None:
                return result

    def _pass(self, attempt: Attempt) -> RunResult | None:
        """One pass of the loop after a wake-up: the result when the run is over."""
        self._shutdown.waker.drain()
        self.last_progress = self._clock.time()
        self._check_shutdown()
        self._watches.note_expired_timers()
        stuck = self._watches.stuck_worker(attempt)
        if stuck is not None:
            return self._fail(stuck=stuck)
        self._watches.check_hang(attempt)
        if self._pace.due():
            self._pace.sample(self._progress.snapshot(), attempt.procs.running())
        if self._inprocess.under_way and self._inprocess.progress() == "late":
            self._abandon_late_round(attempt)
            return None
        laggards = self._inprocess.stuck()
        if laggards:
            self._inprocess.end_stuck(attempt, laggards)  # their exits come as failures
            return None
        exits = attempt.procs.exits
        failed = sorted((e for e in exits.values() if e.exitcode != 0), key=lambda e: e.observed_at)
        if failed:
            return self._after_failure(attempt, failed)
        if not attempt.procs.running():
            # None: the round failed elsewhere, and this node re-formed and restarted.
            return self._succeed(attempt)
        self._watches.check_stuck_at_exit(attempt)
        if self._handler.num_nodes_waiting() > 0:
            self._reform_for_waiting_nodes()
        return None

    def _after_failure(self, attempt: Attempt, failed: list[Exit]) -> RunResult | None:
        """Restart (None) or end the run with its failed result."""
        if self._no_progress_since_restarts():
            return self._fail()
        what = failures.describe_failure(attempt, failed[0])
        # The job-wide budget lives in the store: a signal must not wait for it.
        decision = self.interruptible(
            functools.partial(self._policy.on_failure, failed, self._budget, what),
            "restart budget",
        )
        if decision is not Decision.RESTART_ALL:
            return self._fail()
        if not self._recover_in_place(attempt, failed):
            self._restart_after_failure(failed)
        return None

    def _recover_in_place(self, attempt: Attempt, failed: list[Exit]) -> bool:
        """Replace only the failed workers when every worker recovers in place
        (``elastrun.inprocess``); False: restart the whole group instead."""
        if self._inprocess.under_way:  # the next round replaces this one's failed too
            self._inprocess.abandon("a worker failed meanwhile")
        why = self._steps.why_not(attempt, failed)
        if why is not None:
            log.debug("not recovering in place: %s", why)
            return False
        self._watches.note_expired_timers()
        self.history.append(
            self._report.restart(attempt, failed, self._watches.reasons, in_place=True)
        )
        self._steps.recover(attempt, failed)
        return True

    def _abandon_late_round(self, attempt: Attempt) -> None:
        """The in-process round took too long: restart the group (the stacks of the
        workers that did not synchronise are kept)."""
        self._inprocess.abandon_late(attempt)
        self.restart_group(None)

    def restart_group(self, plan: LaunchPlan | None) -> None:
        """Stop the workers and start them afresh, in ``plan`` (a round already joined)
        or in a new round (after an in-process recovery failed: the failure that led to
        it was already charged to the budget). For ``InprocessSteps``."""
        if plan is None:
            self._phases.move(AgentPhase.RESTARTING)
        self._finish_attempt(signal.SIGTERM)
        self._transition(WorkerState.STOPPED)
        self._check_shutdown()
        if plan is None:
            self._start_round()
        else:
            self._start_workers(plan)

    def move(self, phase: AgentPhase) -> None:
        """Enter ``phase`` (for ``InprocessSteps``)."""
        self._phases.move(phase)

    def _reform_for_waiting_nodes(self) -> None:
        why = self._rdzv.change_reason or "nodes are waiting to join"
        attempt = self._attempt
        assert attempt is not None
        self._report.membership_change(why)
        if self._inprocess.under_way:  # the re-formed group's round replaces this one
            self._inprocess.abandon(f"the group re-forms ({why})")
        if self._steps.why_not(attempt, [], reform=True) is None:
            log.info("%s: re-forming the group; the workers keep running meanwhile", why)
            self._steps.reform_keeping(attempt)
            return
        log.info("%s: re-forming the group (no restart counted here)", why)
        self._finish_attempt(signal.SIGTERM)
        self._transition(WorkerState.STOPPED)
        self._start_round()

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

    # -- a round: rendezvous, plan, start ----------------------------------------------

    def _start_round(self) -> None:
        self._rounds.end()  # the previous round is over for every node
        self._phases.move(AgentPhase.RENDEZVOUS)
        plan = self._steps.starting_afresh(self._rounds.join(), self._attempt)
        self._start_workers(plan)
        assert self._attempt is not None
        self._steps.joined(self._attempt)

    def _start_workers(self, plan: LaunchPlan) -> None:
        t0 = self._clock.monotonic()
        number = self._attempts
        self._attempts += 1
        attempt = self._attempt = self._workers.start(plan, number)
        self._pace.start_attempt(number, {w.local_rank: w.ranks.global_rank for w in plan.workers})
        self._transition(WorkerState.HEALTHY)
        self._phases.move(AgentPhase.RUNNING)
        self._report.workers_started(attempt, (self._clock.monotonic() - t0) * 1000)

    # -- stopping, restarting, finishing -----------------------------------------------

    def _finish_attempt(self, sig: int) -> None:
        """Stop whatever still runs of the current attempt and drain its output."""
        if self._attempt is not None:
            self._workers.stop(self._attempt, sig)

    def _restart_after_failure(self, failed: list[Exit]) -> None:
        self._phases.move(AgentPhase.RESTARTING)
        t0 = self._clock.monotonic()
        attempt = self._attempt
        assert attempt is not None
        self._watches.note_expired_timers()
        self.history.append(self._report.restart(attempt, failed, self._watches.reasons))
        self._finish_attempt(signal.SIGTERM)
        self._transition(WorkerState.STOPPED)
        self._check_shutdown()
        self._start_round()
        self._metrics.put("agent.restart.duration_ms", (self._clock.monotonic() - t0) * 1000)

    def _fail(self, stuck: int | None = None) -> RunResult:
        """Stop everything and report: the restart budget ran out, or a worker is stuck
        in uninterruptible sleep (``stuck``: its local rank; restarting cannot help)."""
        attempt = self._attempt
        assert attempt is not None
        self._finish_attempt(signal.SIGTERM)
        self._watches.note_expired_timers()
        reasons = self._watches.reasons
        report = failures.process_failures(attempt, host=self._host, reasons=reasons, stuck=stuck)
        failed = failures.failed_exits(attempt)
        failures.record_failures(self._events, attempt, failed, restart=False, stuck=stuck)
        self.budget_note = failures.failure_note(
            self._budget, stuck=stuck, stalled=self.stalled, history=self.history
        )
        self._transition(WorkerState.FAILED)
        self._report.failed(len(report))
        return RunResult(state=WorkerState.FAILED, failures=report)

    def _succeed(self, attempt: Attempt) -> RunResult | None:
        """Every local worker finished: wait for the round's outcome on every node.

        Returns the result, or None when a failure elsewhere restarted the round (this
        node re-formed with the others and its workers run again).
        """
        values = return_values(attempt)
        self._finish_attempt(signal.SIGTERM)
        self._phases.move(AgentPhase.EXIT_BARRIER)
        if self._rdzv.has_exit_barrier and (self._group.group_world_size or 1) > 1:
            log.info("workers finished; waiting for the other nodes (exit barrier)")
            outcome = self.interruptible(
                lambda: self._rdzv.exit_barrier(self._exit_barrier_timeout), "exit barrier"
            )
            result = self._after_barrier(outcome)
            if not isinstance(result, bool):
                return result
        self._transition(WorkerState.SUCCEEDED)
        self._report.succeeded(len(values))
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def _after_barrier(self, outcome: BarrierResult) -> RunResult | bool | None:
        """Act on the round's outcome: True to finish successfully, None after
        re-forming (restart), or the failed result."""
        action = barrier_action(outcome)
        if action is BarrierAction.FINISH:
            return True
        if action is BarrierAction.REFORM:
            self._report.membership_change(outcome.reason)
            self._transition(WorkerState.STOPPED)
            self._start_round()
            return None
        self.budget_note = f"the job failed on another node: {outcome.reason}"
        self._transition(WorkerState.FAILED)
        self._report.failed(0)
        return RunResult(state=WorkerState.FAILED, failures={})

    def _no_progress_since_restarts(self) -> bool:
        """Whether the last restarts made no progress (then: stop, with ``stalled`` set).

        Judged from the attempt that just failed, before its records are reset."""
        self.stalled = self._progress.stalled()
        if self.stalled is None:
            return False
        log.error("not restarting: %s", self.stalled)
        self._events.record("agent.no_progress", {"detail": self.stalled})
        return True

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

    def __repr__(self) -> str:
        return (
            f"LocalElasticAgent(role={self._spec.role!r}, state={self._group.state.value}, "
            f"attempts={self._attempts}, budget={self._budget!r})"
        )
