"""The elastic loop of one node: rendezvous -> plan -> start -> watch -> restart / finish.

The loop blocks on events -- a worker exit through its pidfd, a stop request through
the shutdown scope (cancelled: ``ShutdownRequested``), a notice that something changed
(``Notices``: a node waits in the rendezvous, a worker's message to the in-process hub)
-- and checks the rendezvous for waiting nodes at most every ``monitor_interval``;
nothing sleeps a fixed time on the recovery path.

The work is done by the parts ``assemble`` built (agent.wiring); they return what they
found or decided (a round's plan, a restart decision, the barrier's action) and the loop
acts on it, entering each phase through the one state machine (``Lifecycle.enter``).
A signal anywhere ends in ``ShutdownRequested``, answered in one place (``run``): the
workers are stopped with that signal. Teardown is one stack of exits, each pushed as
its part is started, so whatever was started is undone, in reverse, even when a step
of the teardown fails.
"""

from __future__ import annotations

import contextlib
import logging
import signal

from elastrun.agent import failures
from elastrun.agent.attempt import Attempt
from elastrun.agent.finish import BarrierAction, barrier_action, return_values
from elastrun.agent.phases import AgentPhase
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.policy import Decision
from elastrun.agent.spec import RunResult, WorkerState
from elastrun.agent.wiring import AgentParts
from elastrun.core.clock import Deadline
from elastrun.core.errors import ElastrunError, RendezvousClosedError, ShutdownRequested
from elastrun.inprocess.agent.steps import GroupAction, GroupDecision
from elastrun.store.tcp.limits import fd_limit
from elastrun.supervise.failures.crashloop import CrashLoopGuard
from elastrun.supervise.processes.procset import Exit

__all__ = ["ElasticLoop"]

log = logging.getLogger("elastrun.agent")


def _ignore() -> None:
    """A change callback that does nothing (set when the loop is over)."""


class ElasticLoop:
    """Runs, watches and restarts the workers of one node, from its assembled parts.

    ``LocalElasticAgent`` (agent.local) is its torch-compatible face.
    """

    def __init__(self, parts: AgentParts) -> None:
        self._p = parts
        self._attempt: Attempt | None = None
        self._attempts = 0
        self.history: list[str] = []  # one line per failure that caused a restart
        self.budget_note: str | None = None
        #: Why restarting stopped because the restarts made no progress (else None).
        self.stalled: str | None = None
        #: Why restarting stopped because a rank failed the same way twice in a row.
        self.crash_loop: str | None = None
        self._crash_loops = CrashLoopGuard() if parts.options.crash_loop_stop else None
        #: Wall-clock time of the loop's last pass (the health check's "last progress").
        self.last_progress = parts.clock.time()

    @property
    def parts(self) -> AgentParts:
        return self._p

    @property
    def attempts(self) -> int:
        """How many times the workers were started."""
        return self._attempts

    def run(self) -> RunResult:
        """Run the workers to completion, restarting them on failure.

        Returns the result (``FAILED`` with the failures when the restart budget ran
        out). Raises ``ShutdownRequested`` after stopping the workers on a signal.
        """
        with contextlib.ExitStack() as exits:
            self._start_services(exits)
            try:
                # The shutdown scope is the thread's current one while the loop runs, so
                # that every wait in it observes the scope, also the store calls deep in
                # the rendezvous that name no scope; the teardown runs outside it.
                return self._p.interruptible(lambda _scope: self._run(), "agent's next step")
            except ShutdownRequested as stop:
                self._stopped_by(stop.signum)
                raise

    def _run(self) -> RunResult:
        self._check_shutdown()
        try:
            self._start_round()
            return self._watch()
        except RendezvousClosedError as exc:
            if not (exc.finished and self._p.cooldown.sat_out):
                raise
            # Kept out (a failed check, or failures of its own), this node sat out a job
            # that succeeded: it ends as the job did (under srun, a node's failure fails
            # the whole step).
            log.info(
                "the job finished while this node was kept out of its rounds: it ends with success"
            )
            return RunResult(state=WorkerState.SUCCEEDED)

    def _start_services(self, exits: contextlib.ExitStack) -> None:
        """Start what runs for the whole loop; push each one's undoing on ``exits``."""
        p = self._p
        exits.callback(p.workers.close)
        if p.owns_shutdown:
            exits.callback(p.shutdown.close)
        exits.callback(p.notices.close)
        if p.file_timer is not None:
            exits.callback(p.file_timer.stop)
        exits.callback(p.guard.close)
        exits.callback(p.progress.close)
        exits.callback(p.pace.close)
        exits.callback(p.inprocess.close)
        exits.callback(p.rounds.end)
        exits.callback(self._finish_attempt, signal.SIGTERM)
        p.rdzv.set_node_info(p.spec.role, p.spec.local_world_size)
        p.cooldown.start()
        # Membership news from the rendezvous' watch thread wakes the loop at once; its
        # threads may outlive the notices, so the callback is taken back first.
        exits.callback(p.rdzv.set_change_callback, _ignore)
        p.rdzv.set_change_callback(p.notices.post)
        exits.callback(p.lifecycle.enter, AgentPhase.DONE)
        p.guard.start()
        if p.options.inprocess:
            p.workers.provide(p.inprocess.open())  # the workers' socket path

    def _watch(self) -> RunResult:
        """Pass after pass, each after a worker exit, a notice or ``monitor_interval``
        (sooner when a worker's question is due an answer): the result.

        Raises:
            ShutdownRequested: a stop request ended the wait.
        """
        while True:
            attempt = self._current()
            self._wait(attempt)
            result = self._pass(attempt)
            if result is not None:
                return result

    def _wait(self, attempt: Attempt) -> None:
        """Until a worker exits, a notice comes or ``monitor_interval`` passes (sooner
        when a worker's question is due an answer), in the shutdown scope."""
        p = self._p
        interval = p.spec.monitor_interval
        due = p.inprocess.next_answer_in()
        deadline = Deadline.after(interval if due is None else min(interval, due), p.clock)
        p.interruptible(
            lambda scope: attempt.procs.wait_for_exits(deadline, scope, p.notices.fileno()),
            "workers",
        )

    def _current(self) -> Attempt:
        attempt = self._attempt
        assert attempt is not None, "no attempt started"  # (the loop starts one first)
        return attempt

    # -- signals -----------------------------------------------------------------------

    def _check_shutdown(self) -> None:
        """Raise ``ShutdownRequested`` when a signal was received (``run`` answers it)."""
        signum = self._p.shutdown.signum
        if signum is not None:
            raise ShutdownRequested(signum)

    def _stopped_by(self, signum: int) -> None:
        """A signal ended the run: stop the workers with it."""
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        if self._attempt is not None:
            grace = self._p.options.shutdown_timeout
            log.warning("received %s: stopping workers (grace %.0fs)", name, grace)
            # Before the workers stop and their peers elsewhere re-form: no one may count
            # this node in the next round before it joins (it never will).
            self._p.rdzv.step_away(f"received {name}")
            self._finish_attempt(signum)
        self._p.events.record("agent.signal", {"signal": name})

    def _finish_attempt(self, sig: int) -> None:
        """Stop whatever still runs of the current attempt and drain its output."""
        if self._attempt is not None:
            self._p.workers.stop(self._attempt, sig)

    def _stop_workers(self) -> None:
        """Stop the current attempt's workers (the phase stays)."""
        self._finish_attempt(signal.SIGTERM)
        self._p.lifecycle.enter(self._p.lifecycle.phase, WorkerState.STOPPED)

    # -- one pass ----------------------------------------------------------------------

    def _pass(self, attempt: Attempt) -> RunResult | None:
        """One pass of the loop after a wake-up: the result when the run is over."""
        p = self._p
        p.notices.take()  # before looking: a notice from now on ends the next wait
        self.last_progress = p.clock.time()
        self._check_shutdown()
        p.watches.note_expired_timers()
        stuck = p.watches.stuck_worker(attempt)
        if stuck is not None:
            return self._fail(stuck=stuck)
        p.watches.check_hang(attempt)
        if p.pace.due():
            p.pace.sample(p.progress.snapshot(), attempt.procs.running())
        if self._inprocess_pass(attempt):
            return None
        exits = attempt.procs.exits
        failed = sorted((e for e in exits.values() if e.exitcode != 0), key=lambda e: e.observed_at)
        if failed:
            return self._after_failure(attempt, failed)
        if not attempt.procs.running():
            # None: the round failed elsewhere, and this node re-formed and restarted.
            return self._succeed(attempt)
        p.watches.check_stuck_at_exit(attempt)
        if p.handler.num_nodes_waiting() > 0:
            self._reform_for_waiting_nodes()
        return None

    def _inprocess_pass(self, attempt: Attempt) -> bool:
        """Answer the workers' questions (did a peer fail?) and follow an in-process
        round under way; True when this pass is over."""
        inprocess = self._p.inprocess
        inprocess.answer(attempt, lambda: self._p.handler.num_nodes_waiting() > 0)
        if inprocess.under_way:
            round_state = inprocess.progress()
            if round_state == "late":
                # Too long: restart the group (the stacks of the workers that did not
                # synchronise are kept).
                inprocess.abandon_late(attempt)
                self._act(GroupDecision.restart_fresh())
                return True
            if round_state == "done" and inprocess.restored is not None:
                self._p.progress.recovered(inprocess.restored)
                inprocess.restored = None
        laggards = inprocess.stuck()
        if laggards:
            inprocess.end_stuck(attempt, laggards)  # their exits come as failures
            return True
        return False

    # -- failures ----------------------------------------------------------------------

    def _after_failure(self, attempt: Attempt, failed: list[Exit]) -> RunResult | None:
        """Restart (None) or end the run with its failed result."""
        p = self._p
        if self._no_progress_since_restarts(attempt, failed):
            return self._fail()
        what = failures.describe_failure(attempt, failed[0])
        if self._crash_loop(attempt, failed, what):
            return self._fail()
        # The job-wide budget lives in the store: a signal must not wait for it.
        decision = p.interruptible(
            lambda _scope: p.policy.on_failure(failed, p.budget, what), "restart budget"
        )
        if decision is not Decision.RESTART_ALL:
            return self._fail()
        try:
            self._recover(attempt, failed)
        except ShutdownRequested:
            raise
        except (OSError, ElastrunError) as exc:
            # Out of descriptors, the restart cannot be made (its files, pipes, sockets
            # and pidfds): the run ends with the failure's report, not a traceback.
            short = failures.out_of_descriptors(exc)
            if short is None:
                raise
            return self._fail(cannot_restart=short)
        return None

    def _recover(self, attempt: Attempt, failed: list[Exit]) -> None:
        """Recover from ``failed`` (the budget allowed it): in place, or by a restart."""
        p = self._p
        if p.inprocess.under_way:  # the next round replaces this one's failed too
            p.inprocess.abandon("a worker failed meanwhile")
        why = p.steps.why_not(attempt, failed)
        if why is not None:
            log.debug("not recovering in place: %s", why)
            self._restart_after_failure(failed)
            return
        p.watches.note_expired_timers()
        self.history.append(p.report.restart(attempt, failed, p.watches.reasons, in_place=True))
        if p.steps.alone:
            self._act(p.steps.recover_alone(attempt, failed))
        else:
            self._reform_keeping(attempt)

    def _restart_after_failure(self, failed: list[Exit]) -> None:
        p = self._p
        p.lifecycle.enter(AgentPhase.RESTARTING)
        t0 = p.clock.monotonic()
        attempt = self._current()
        p.watches.note_expired_timers()
        self.history.append(p.report.restart(attempt, failed, p.watches.reasons))
        p.nodecheck.own_failure()  # this node's workers failed: check it before it rejoins
        self._stop_workers()
        self._check_shutdown()
        self._start_round()
        p.metrics.put("agent.restart.duration_ms", (p.clock.monotonic() - t0) * 1000)

    def _no_progress_since_restarts(self, attempt: Attempt, failed: list[Exit]) -> bool:
        """Whether the last restarts made no progress (then: stop, with ``stalled`` set).

        A failure recovered in place is judged by the commits the last recoveries
        restored (the job's progress; a replacement's own step counts start at 0); one
        during a recovery belongs to that recovery, judged when it completes. Else it is
        judged from the attempt that just failed, before its records are reset."""
        p = self._p
        if p.inprocess.under_way:
            return False
        if p.steps.why_not(attempt, failed) is None:
            self.stalled = p.progress.stalled_in_place()
        else:
            self.stalled = p.progress.stalled()
        if self.stalled is None:
            return False
        log.error("not restarting: %s", self.stalled)
        p.events.record("agent.no_progress", {"detail": self.stalled})
        return True

    def _crash_loop(self, attempt: Attempt, failed: list[Exit], what: str) -> bool:
        """Whether a rank failed as in the attempt before (then: stop, with
        ``crash_loop`` set, and the job ends on every node).

        A failure recovered in place is left to the in-process guard (its replacement
        counts its steps from 0, and the attempt goes on)."""
        p = self._p
        guard = self._crash_loops
        if guard is None or p.inprocess.under_way or p.steps.why_not(attempt, failed) is None:
            return False
        found = failures.signatures(attempt, failed, p.progress.snapshot())
        repeated = guard.attempt_failed(attempt.number, found)
        if repeated is None:
            return False
        # With no restart left the budget ends the job anyway, as torchrun's would (exit
        # status 1): the verdict only saves the restarts that remain.
        left = p.interruptible(lambda _scope: p.budget.limit - p.budget.used, "restart budget")
        if left <= 0:
            return False
        self.crash_loop = (
            f"{repeated.describe()}, in attempts {attempt.number - 1} and {attempt.number} alike"
        )
        log.error("not restarting: the failure looks deterministic: %s", self.crash_loop)
        p.events.record(
            "agent.crash_loop",
            {
                "rank": repeated.rank,
                "error": repeated.error,
                "step": repeated.step,
                "attempt": attempt.number,
            },
        )
        why = f"crash loop: {repeated.describe()} twice in a row"
        # Every node ends: the failure is claimed for the round with no restart, and the
        # run is closed with why (a signal must not wait for the store).
        p.interruptible(lambda _scope: p.rdzv.report_final_failure(what, why), "ending the job")
        return True

    # -- the group: kept, or restarted ---------------------------------------------------

    def _act(self, decision: GroupDecision) -> None:
        """Do what an in-process step decided for the worker group."""
        if decision.action is GroupAction.KEPT:
            self._p.lifecycle.enter(AgentPhase.RUNNING)
        elif decision.action is GroupAction.RESTART_IN_ROUND:
            assert decision.plan is not None, "a restart in a round names its plan"
            self._restart_in(decision.plan)
        else:
            # A failed in-process recovery: the failure that led to it was already
            # charged to the budget.
            self._p.lifecycle.enter(AgentPhase.RESTARTING)
            self._stop_workers()
            self._check_shutdown()
            self._start_round()

    def _restart_in(self, plan: LaunchPlan) -> None:
        """Stop the workers and start them afresh in ``plan`` (a round already joined)."""
        self._stop_workers()
        self._check_shutdown()
        self._start_workers(plan)

    def _reform_keeping(self, attempt: Attempt) -> None:
        """Join the next round with the workers running; keep or restart them there."""
        self._p.rounds.end()
        self._p.lifecycle.enter(AgentPhase.RENDEZVOUS)
        self._act(self._p.steps.reform_keeping(attempt))

    def _reform_for_waiting_nodes(self) -> None:
        p = self._p
        why = p.rdzv.change_reason or "nodes are waiting to join"
        attempt = self._current()
        p.report.membership_change(why)
        if p.inprocess.under_way:  # the re-formed group's round replaces this one
            p.inprocess.abandon(f"the group re-forms ({why})")
        if p.steps.why_not(attempt, [], reform=True) is None:
            log.info("%s: re-forming the group; the workers keep running meanwhile", why)
            self._reform_keeping(attempt)
            return
        log.info("%s: re-forming the group (no restart counted here)", why)
        self._stop_workers()
        self._start_round()

    # -- a round: rendezvous, plan, start ----------------------------------------------

    def _start_round(self) -> None:
        p = self._p
        p.rounds.end()  # the previous round is over for every node
        p.lifecycle.enter(AgentPhase.RENDEZVOUS)
        p.nodecheck.before_round()  # when due: the first round, or after its own failure
        while p.cooldown.before_round():  # an excluded node sits out its cool-down first
            p.nodecheck.own_failure()  # and, back, is checked again (it may go out again)
            p.nodecheck.before_round()
        plan = p.steps.starting_afresh(p.rounds.join(), self._attempt)
        self._start_workers(plan)
        p.steps.joined(self._current())

    def _start_workers(self, plan: LaunchPlan) -> None:
        p = self._p
        t0 = p.clock.monotonic()
        number = self._attempts
        self._attempts += 1
        attempt = self._attempt = p.workers.start(plan, number)
        p.pace.start_attempt(number, {w.local_rank: w.ranks.global_rank for w in plan.workers})
        p.lifecycle.enter(AgentPhase.RUNNING, WorkerState.HEALTHY)
        p.report.workers_started(attempt, (p.clock.monotonic() - t0) * 1000)

    # -- the end -----------------------------------------------------------------------

    def _fail(self, stuck: int | None = None, cannot_restart: str | None = None) -> RunResult:
        """Stop everything and report: the restart budget ran out, a worker is stuck in
        uninterruptible sleep (``stuck``: its local rank; restarting cannot help), or the
        process ran out of descriptors restarting (``cannot_restart``: the error)."""
        p = self._p
        if cannot_restart is not None:
            cannot_restart = (
                "the agent ran out of file descriptors restarting the workers "
                f"(its limit: {fd_limit()}, ulimit -n): {cannot_restart}"
            )
            log.error("not restarting: %s", cannot_restart)
        attempt = self._current()
        p.rdzv.step_away("its agent gave up")  # (before its workers stop: see _stopped_by)
        self._finish_attempt(signal.SIGTERM)
        p.watches.note_expired_timers()
        reasons = p.watches.reasons
        report = failures.process_failures(attempt, host=p.host, reasons=reasons, stuck=stuck)
        failed = failures.failed_exits(attempt)
        failures.record_failures(p.events, attempt, failed, restart=False, stuck=stuck)
        self.budget_note = failures.failure_note(
            p.budget,
            stuck=stuck,
            stalled=self.stalled,
            history=self.history,
            crash_loop=self.crash_loop,
            cannot_restart=cannot_restart,
        )
        p.lifecycle.enter(AgentPhase.DONE, WorkerState.FAILED)
        p.report.failed(len(report))
        return RunResult(state=WorkerState.FAILED, failures=report)

    def _succeed(self, attempt: Attempt) -> RunResult | None:
        """Every local worker finished: wait for the round's outcome on every node.

        Returns the result, or None when a failure elsewhere restarted the round (this
        node re-formed with the others and its workers run again).
        """
        p = self._p
        values = return_values(attempt)
        self._finish_attempt(signal.SIGTERM)
        p.lifecycle.enter(AgentPhase.EXIT_BARRIER)
        action, reason = BarrierAction.FINISH, ""
        if p.rdzv.has_exit_barrier and (p.group.group_world_size or 1) > 1:
            log.info("workers finished; waiting for the other nodes (exit barrier)")
            timeout = p.options.exit_barrier_timeout
            outcome = p.interruptible(lambda _scope: p.rdzv.exit_barrier(timeout), "exit barrier")
            action, reason = barrier_action(outcome), outcome.reason
        if action is BarrierAction.REFORM:
            p.report.membership_change(reason)
            p.lifecycle.enter(AgentPhase.EXIT_BARRIER, WorkerState.STOPPED)
            try:
                self._start_round()
                return None
            except RendezvousClosedError as exc:
                # The failure that re-formed the round ended the job (its node's budget
                # ran out) after this node joined the next round: the same outcome as
                # when the barrier says so, only seen later.
                self._finish_attempt(signal.SIGTERM)
                action, reason = BarrierAction.FAIL, str(exc)
        if action is BarrierAction.FAIL:
            self.budget_note = f"the job failed on another node: {reason}"
            p.lifecycle.enter(AgentPhase.DONE, WorkerState.FAILED)
            p.report.failed(0)
            return RunResult(state=WorkerState.FAILED, failures={})
        p.lifecycle.enter(AgentPhase.DONE, WorkerState.SUCCEEDED)
        p.report.succeeded(len(values))
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def __repr__(self) -> str:
        return (
            f"ElasticLoop(role={self._p.spec.role!r}, lifecycle={self._p.lifecycle!r}, "
            f"attempts={self._attempts}, budget={self._p.budget!r})"
        )
