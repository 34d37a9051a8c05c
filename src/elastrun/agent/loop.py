"""The elastic loop of one node: rendezvous -> plan -> start -> watch -> restart / finish.

The loop blocks on events -- a worker exit through its pidfd, a stop request through
the shutdown scope (cancelled: ``ShutdownRequested``), a notice that something changed
(``Notices``: a node waits in the rendezvous, a worker's message to the in-process hub)
-- and checks the rendezvous for waiting nodes at most every ``monitor_interval``;
nothing sleeps a fixed time on the recovery path.

The work is done by the parts ``assemble`` built (launch.assemble); they return what they
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
from elastrun.agent.ladder import GroupAction, GroupDecision, Move, Reaction
from elastrun.agent.parts import AgentParts
from elastrun.agent.phases import AgentPhase
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.spec import RunResult, WorkerState
from elastrun.core.clock import Deadline
from elastrun.core.errors import ElastrunError, RendezvousClosedError, ShutdownRequested
from elastrun.store.tcp.limits import fd_limit
from elastrun.supervise.processes.procset import Exit

__all__ = ["ElasticLoop"]

log = logging.getLogger("elastrun.agent")


class ElasticLoop:
    """Runs, watches and restarts the workers of one node, from its assembled parts.

    ``LocalElasticAgent`` (launch.local_agent) is its torch-compatible face.
    """

    def __init__(self, parts: AgentParts) -> None:
        self._p = parts
        self._attempt: Attempt | None = None
        #: How many times the workers were started.
        self.attempts = 0
        self.history: list[str] = []  # one line per failure that caused a restart
        self.budget_note: str | None = None
        #: Why restarting stopped because the restarts made no progress (else None).
        self.stalled: str | None = None
        #: Why restarting stopped because a rank failed the same way twice in a row.
        self.crash_loop: str | None = None
        #: Wall-clock time of the loop's last pass (the health check's "last progress").
        self.last_progress = parts.clock.time()

    @property
    def parts(self) -> AgentParts:
        return self._p

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
                return self._p.interruptible.run(self._run, "agent's next step")
            except ShutdownRequested as stop:
                self._stopped_by(stop)
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
        # Undone in the reverse order. The orphan guard is told goodbye last: an agent
        # killed during its own teardown (a second signal's SIGKILL) leaves its workers
        # and its node's checkpoint directory to the guard, until the very end.
        exits.callback(p.guard.close)
        exits.callback(p.workers.close)
        if p.owns_shutdown:
            exits.callback(p.shutdown.close)
        exits.callback(p.notices.close)
        if p.file_timer is not None:
            exits.callback(p.file_timer.stop)
        exits.callback(p.progress.close)
        exits.callback(p.pace.close)
        exits.callback(p.ladder.follower.close)
        exits.callback(p.rounds.end)
        # Right after the attempt stops, before the closes that may wait on other nodes
        # (a partitioned node's pace exchange takes seconds): the node's checkpoints,
        # after the workers' last reports.
        exits.callback(p.checkpoints.close)
        exits.callback(p.checkpoint_reports.finish)
        exits.callback(self._finish_attempt, signal.SIGTERM)
        p.rdzv.set_node_info(p.spec.role, p.spec.local_world_size)
        p.cooldown.start()
        # Membership news from the rendezvous' watch thread wakes the loop at once; its
        # threads may outlive the notices, so the callback is taken back first.
        exits.callback(p.rdzv.set_change_callback, lambda: None)
        p.rdzv.set_change_callback(p.notices.post)
        exits.callback(p.lifecycle.enter, AgentPhase.DONE)
        p.guard.start()
        p.workers.provide(p.ladder.follower.open())  # (in place: the workers' socket path)
        p.workers.provide(p.checkpoints.open(p.handler.get_run_id()))

    def _watch(self) -> RunResult:
        """Pass after pass, each after ``_wait``: the result.

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
        due = p.ladder.follower.wake_in()
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

    def _stopped_by(self, stop: ShutdownRequested) -> None:
        """A signal ended the run: stop the workers with it."""
        name = stop.signal_name
        if self._attempt is not None:
            grace = self._p.options.shutdown_timeout
            log.warning("received %s: stopping workers (grace %.0fs)", name, grace)
            # Before the workers stop and their peers elsewhere re-form: no one may count
            # this node in the next round before it joins (it never will).
            self._p.rdzv.step_away(f"received {name}")
            self._finish_attempt(stop.signum)
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
        if p.checkpoint_reports.due():
            p.checkpoint_reports.collect()
        step = p.ladder.follower.on_pass(attempt)
        if step is not None:
            self._act(step)
            return None
        failed = failures.failed_exits(attempt)
        if failed:
            return self._after_failure(attempt, failed)
        if not attempt.procs.running():
            # None: the round failed elsewhere, and this node re-formed and restarted.
            return self._succeed(attempt)
        p.watches.check_stuck_at_exit(attempt)
        if p.handler.num_nodes_waiting() > 0:
            self._reform_for_waiting_nodes()
        return None

    # -- failures ----------------------------------------------------------------------

    def _after_failure(self, attempt: Attempt, failed: list[Exit]) -> RunResult | None:
        """Ask the recovery ladder, and carry its answer out: recover (None) or end the
        run with its failed result."""
        # The failed attempt's last memory checkpoint reports, before a restarted
        # worker's report replaces its predecessor's (and for the ladder to read).
        self._p.checkpoint_reports.collect()
        reaction = self._p.ladder.on_failure(attempt, failed)
        if reaction.move is Move.STOP:
            self.stalled, self.crash_loop = reaction.stalled, reaction.crash_loop
            return self._fail()
        try:
            self._recover(attempt, failed, reaction)
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

    def _recover(self, attempt: Attempt, failed: list[Exit], reaction: Reaction) -> None:
        """Record the failure, then carry out the move and step a rung chose."""
        p = self._p
        t0 = p.clock.monotonic()
        restart = reaction.move is Move.RESTART
        if restart:
            p.lifecycle.enter(AgentPhase.RESTARTING)
        reasons = p.watches.note_expired_timers()
        self.history.append(
            p.report.restart(
                attempt, failed, reasons, in_place=not restart, from_memory=reaction.from_memory
            )
        )
        self._carry_out(reaction)
        if restart:
            p.metrics.put("agent.restart.duration_ms", (p.clock.monotonic() - t0) * 1000)

    # -- the group: kept, or restarted ---------------------------------------------------

    def _carry_out(self, reaction: Reaction) -> None:
        """The move a rung of the ladder chose, then its step."""
        assert reaction.then is not None, "a recovery names its step"
        if reaction.move is Move.REJOIN:
            # With the workers running, into the next round (the step joins it).
            self._p.rounds.end()
            self._p.lifecycle.enter(AgentPhase.RENDEZVOUS)
        self._act(reaction.then())

    def _act(self, decision: GroupDecision) -> None:
        """Do what a rung's step decided for the worker group."""
        match decision.action, decision.plan:
            case GroupAction.KEPT, _:
                self._p.lifecycle.enter(AgentPhase.RUNNING)
            case GroupAction.RESTART_IN_ROUND, LaunchPlan() as plan:
                self._stop_workers()
                self._check_shutdown()
                self._start_workers(plan)
            case _:
                # A restart in a new round (after a failed recovery in place too: the
                # failure that led to it was already charged to the budget).
                self._p.lifecycle.enter(AgentPhase.RESTARTING)
                self._stop_workers()
                self._check_shutdown()
                self._start_round()

    def _reform_for_waiting_nodes(self) -> None:
        p = self._p
        why = p.rdzv.change_reason or "nodes are waiting to join"
        p.report.membership_change(why)
        reaction = p.ladder.follower.on_reform(self._current(), why)
        if reaction.move is Move.REJOIN:
            self._carry_out(reaction)
            return
        self._stop_workers()  # (no restart counted here)
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
        plan = p.ladder.follower.starting(p.rounds.join(), self._attempt)
        self._start_workers(plan)
        p.ladder.follower.started(self._current())

    def _start_workers(self, plan: LaunchPlan) -> None:
        p = self._p
        t0 = p.clock.monotonic()
        number = self.attempts
        self.attempts += 1
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
        reasons = p.watches.note_expired_timers()
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
        if (job := p.rdzv.outcome) is not None and (p.group.group_world_size or 1) > 1:
            log.info("workers finished; waiting for the other nodes (exit barrier)")
            timeout = p.options.exit_barrier_timeout
            outcome = p.interruptible.run(lambda: job.exit_barrier(timeout), "exit barrier")
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
            f"attempts={self.attempts}, budget={self._p.budget!r})"
        )
