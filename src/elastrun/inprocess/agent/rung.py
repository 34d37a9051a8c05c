"""In-process recovery as a rung of the recovery ladder (``agent.ladder``), and the part
that follows the workers between failures: it answers their questions, follows the
in-process round under way, and keeps the workers running through a re-formation:
what the ladder asks of ``InprocessRecovery`` and ``InprocessSteps``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from elastrun.agent.attempt import Attempt
from elastrun.agent.ladder import Failure, GroupDecision, Reaction
from elastrun.agent.plan import LaunchPlan
from elastrun.inprocess.agent.recovery import InprocessRecovery
from elastrun.inprocess.agent.round import RoundState
from elastrun.inprocess.agent.steps import InprocessSteps
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.supervise.processes.procset import Exit

__all__ = ["InPlaceRung"]

log = logging.getLogger("elastrun.agent")


class InPlaceRung:
    """Replaces only the failed workers when every worker uses ``elastrun.inprocess``.

    Args:
        recovery: judges the workers and leads them into rounds.
        steps: carries a recovery through the rendezvous.
        progress: told the commit each completed recovery restored.
        nodes_waiting: whether nodes wait to join (the group is about to re-form).
        enabled: in-process recovery is offered to the workers (``--inprocess``).
    """

    def __init__(
        self,
        recovery: InprocessRecovery,
        steps: InprocessSteps,
        progress: ProgressWatch,
        nodes_waiting: Callable[[], bool],
        *,
        enabled: bool,
    ) -> None:
        self._recovery = recovery
        self._round = recovery.round
        self._steps = steps
        self._progress = progress
        self._nodes_waiting = nodes_waiting
        self._enabled = enabled

    # -- the rung --------------------------------------------------------------------------

    def decide(self, failure: Failure) -> Reaction | None:
        if failure.in_place is not None:
            log.debug("not recovering in place: %s", failure.in_place)
            return None
        attempt, failed = failure.attempt, list(failure.failed)
        if self._steps.alone:
            return Reaction.in_place(lambda: self._steps.recover_alone(attempt, failed))
        # With other nodes: the workers run on while the node joins the next round.
        return Reaction.rejoin(lambda: self._steps.reform_keeping(attempt))

    # -- following the workers ---------------------------------------------------------------

    def open(self) -> dict[str, str]:
        return self._recovery.open() if self._enabled else {}

    def close(self) -> None:
        self._recovery.close()

    def assess(self, attempt: Attempt, failed: Sequence[Exit]) -> tuple[bool, str | None]:
        recovering = self._round.under_way
        if recovering:  # the next round replaces this one's failed too
            self._round.abandon("a worker failed meanwhile")
        return recovering, self._steps.why_not(attempt, list(failed))

    def on_pass(self, attempt: Attempt) -> GroupDecision | None:
        self._recovery.answer(attempt, self._nodes_waiting)
        current = self._round
        state = current.state()
        if state is RoundState.LATE:
            # Too long: restart the group (the stacks of the workers that did not
            # synchronise are kept).
            current.abandon_late(attempt)
            return GroupDecision.restart_fresh()
        if state is RoundState.DONE:
            restored = current.complete()
            if restored is not None:
                self._progress.recovered(restored)
        laggards = current.stuck()
        if laggards:
            current.end_stuck(attempt, laggards)  # their exits come as failures
            return GroupDecision.kept()
        return None

    def wake_in(self) -> float | None:
        return self._recovery.next_answer_in()

    def on_reform(self, attempt: Attempt, why: str) -> Reaction:
        if self._round.under_way:  # the re-formed group's round replaces this one
            self._round.abandon(f"the group re-forms ({why})")
        if self._steps.why_not(attempt, [], reform=True) is None:
            log.info("%s: re-forming the group; the workers keep running meanwhile", why)
            return Reaction.rejoin(lambda: self._steps.reform_keeping(attempt))
        log.info("%s: re-forming the group (no restart counted here)", why)
        return Reaction.restart(GroupDecision.restart_fresh)

    def starting(self, plan: LaunchPlan, previous: Attempt | None) -> LaunchPlan:
        return self._steps.starting_afresh(plan, previous)

    def started(self, attempt: Attempt) -> None:
        self._steps.joined(attempt)

    def __repr__(self) -> str:
        return f"InPlaceRung(enabled={self._enabled}, recovery={self._recovery!r})"
