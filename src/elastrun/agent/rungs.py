"""The rungs of the recovery ladder (``agent.ladder``) that are not in place: the rules
that end the run, and the group restart that answers every failure they let through.
The in-place rung is in-process recovery's (``inprocess.agent.rung``)."""

from __future__ import annotations

import logging

from elastrun.agent import failures
from elastrun.agent.ladder import Failure, GroupDecision, Reaction
from elastrun.agent.policy import RestartBudget
from elastrun.checkpoint.agent.reports import CheckpointReports
from elastrun.core.interrupt import Interruptible
from elastrun.nodecheck.agent.check import NodeCheck
from elastrun.observe.sinks import EventSink
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.rendezvous.elastic import JobOutcome
from elastrun.supervise.failures.crashloop import CrashLoopGuard

__all__ = ["BudgetRung", "CrashLoopRung", "GroupRestartRung", "StallRung"]

log = logging.getLogger("elastrun.agent")


class StallRung:
    """Stops the run when the last restarts made no progress (``--stalled-restarts``).

    A failure recovered in place is judged by the commits the last recoveries restored
    (the job's progress; a replacement's own step counts start at 0); one during a
    recovery belongs to that recovery, judged when it completes. Else it is judged from
    the attempt that just failed, before its records are reset.
    """

    def __init__(self, progress: ProgressWatch, events: EventSink) -> None:
        self._progress = progress
        self._events = events

    def decide(self, failure: Failure) -> Reaction | None:
        if failure.recovering:
            return None
        progress = self._progress
        stalled = progress.stalled_in_place() if failure.in_place is None else progress.stalled()
        if stalled is None:
            return None
        log.error("not restarting: %s", stalled)
        self._events.record("agent.no_progress", {"detail": stalled})
        return Reaction.stop(stalled=stalled)


class CrashLoopRung:
    """Stops the run, on every node, when a rank failed as in the attempt before.

    A failure recovered in place is left to the stall rule (its replacement counts its
    steps from 0, and the attempt goes on). With no restart left the budget ends the
    job anyway, as torchrun's would (exit status 1): the verdict only saves the
    restarts that remain.
    """

    def __init__(
        self,
        progress: ProgressWatch,
        budget: RestartBudget,
        outcome: JobOutcome | None,
        interruptible: Interruptible,
        events: EventSink,
    ) -> None:
        self._guard = CrashLoopGuard()
        self._progress = progress
        self._budget = budget
        self._outcome = outcome
        self._interruptible = interruptible
        self._events = events

    def decide(self, failure: Failure) -> Reaction | None:
        if failure.recovering or failure.in_place is None:
            return None
        attempt = failure.attempt
        found = failures.signatures(attempt, list(failure.failed), self._progress.snapshot())
        repeated = self._guard.attempt_failed(attempt.number, found)
        if repeated is None:
            return None
        budget = self._budget
        left = self._interruptible.run(lambda: budget.limit - budget.used(), "restart budget")
        if left <= 0:
            return None
        crash_loop = (
            f"{repeated.describe()}, in attempts {attempt.number - 1} and {attempt.number} alike"
        )
        log.error("not restarting: the failure looks deterministic: %s", crash_loop)
        self._events.record(
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
        # run is closed with why (a signal must not wait for the store). With no job-wide
        # outcome each node ends on its own.
        if (outcome := self._outcome) is not None:
            self._interruptible.run(
                lambda: outcome.report_final_failure(failure.what, why), "ending the job"
            )
        return Reaction.stop(crash_loop=crash_loop)


class BudgetRung:
    """Charges the failure to the restart budget; stops the run when none is left."""

    def __init__(self, budget: RestartBudget, interruptible: Interruptible) -> None:
        self._budget = budget
        self._interruptible = interruptible

    def decide(self, failure: Failure) -> Reaction | None:
        # The job-wide budget lives in the store: a signal must not wait for it.
        restart = self._interruptible.run(
            lambda: self._budget.try_consume(failure.what), "restart budget"
        )
        return None if restart else Reaction.stop()


class GroupRestartRung:
    """Every worker starts again in a new round, as under torchrun; the node checks
    itself first when checks are on (its workers failed).

    Nothing changes for workers that use memory checkpoints: the restarted script
    loads the newest step from the node's memory itself. The rung only says so, from
    the reports of the failed attempt's workers (``memory``): the newest step they
    reported complete on every rank, which is the step loaded unless a newer one was
    completed after the last report, or the next round has another world size (then
    none is loaded; ``agent.checkpoint_restored`` tells what was).

    Args:
        nodecheck: the node's own check.
        memory: the workers' memory checkpoint reports (None: not said).
    """

    def __init__(self, nodecheck: NodeCheck, memory: CheckpointReports | None = None) -> None:
        self._nodecheck = nodecheck
        self._memory = memory

    def decide(self, failure: Failure) -> Reaction:
        step = None
        if self._memory is not None:
            pids = {p.pid for p in failure.attempt.procs.processes.values()}
            step = self._memory.newest(pids)
        return Reaction.restart(self._step, from_memory=step)

    def _step(self) -> GroupDecision:
        self._nodecheck.own_failure()  # check it before it rejoins
        return GroupDecision.restart_fresh()
