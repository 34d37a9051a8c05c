"""``LocalElasticAgent``: the elastic loop of one node.

rendezvous -> plan -> start -> watch -> restart / finish. The loop blocks on events
(a worker exit through its pidfd, a signal through the shutdown waker) and checks the
rendezvous for waiting nodes at most every ``monitor_interval``; nothing sleeps a fixed
time on the recovery path.

The loop and the phase transitions live here; the work is done by collaborators,
built by ``AgentWiring`` (agent.wiring):
``Rounds`` (agent.rounds) joins each round and plans it, ``WorkerProcesses``
(agent.workers) starts and stops each attempt's processes, ``AttemptWatches``
(agent.watches) watches the running workers, ``AgentReport`` (agent.report) logs,
counts and records each step; agent.failures and agent.finish word the failures and
read the round's outcome.
"""

from __future__ import annotations

import functools
import logging
import signal

from elastrun.agent import failures
from elastrun.agent.attempt import Attempt
from elastrun.agent.finish import BarrierAction, barrier_action, return_values
from elastrun.agent.phases import AgentPhase
from elastrun.agent.plan import INPROCESS_ENV, LaunchPlan
from elastrun.agent.policy import Decision
from elastrun.agent.spec import RunResult, WorkerState
from elastrun.agent.watches import STUCK_EXIT_TIMEOUT, FileTimer
from elastrun.agent.wiring import AgentWiring
from elastrun.agent.workers import Guard
from elastrun.core.clock import Deadline
from elastrun.rendezvous.api import BarrierResult
from elastrun.supervise.processes.procset import Exit

__all__ = ["STUCK_EXIT_TIMEOUT", "FileTimer", "Guard", "LocalElasticAgent"]

log = logging.getLogger("elastrun.agent")


class LocalElasticAgent(AgentWiring):
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
        console: where tee'd lines are shown: ``sys.stdout``/``sys.stderr`` as they are
            at each start of the workers (torch's behaviour, so ``redirect_stdout`` or a
            notebook cell sees them) by default; the CLI passes ``FD_CONSOLE``.
        starter, policy, budget, clock, environ, python, events, guard: injected
            collaborators (production defaults when None).
    """

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
            self._workers.provide(self._inprocess.open())  # the workers' socket path
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
        if self._inprocess.under_way:
            round_state = self._inprocess.progress()
            if round_state == "late":
                self._abandon_late_round(attempt)
                return None
            if round_state == "done" and self._inprocess.restored is not None:
                self._progress.recovered(self._inprocess.restored)
                self._inprocess.restored = None
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
        if self._no_progress_since_restarts(attempt, failed):
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

    def _no_progress_since_restarts(self, attempt: Attempt, failed: list[Exit]) -> bool:
        """Whether the last restarts made no progress (then: stop, with ``stalled`` set).

        A failure recovered in place is judged by the commits the last recoveries
        restored (the job's progress; a replacement's own step counts start at 0); one
        during a recovery belongs to that recovery, judged when it completes. Else it is
        judged from the attempt that just failed, before its records are reset."""
        if self._inprocess.under_way:
            return False
        if self._steps.why_not(attempt, failed) is None:
            self.stalled = self._progress.stalled_in_place()
        else:
            self.stalled = self._progress.stalled()
        if self.stalled is None:
            return False
        log.error("not restarting: %s", self.stalled)
        self._events.record("agent.no_progress", {"detail": self.stalled})
        return True

    def __repr__(self) -> str:
        return (
            f"LocalElasticAgent(role={self._spec.role!r}, state={self._group.state.value}, "
            f"attempts={self._attempts}, budget={self._budget!r})"
        )
