"""The recovery ladder: how the loop answers a worker failure, and what it runs meanwhile.

On a failure the loop hands the attempt and its failed exits to ``Ladder.on_failure``.
The ladder gathers the facts every rung reads once (``Failure``: the root cause's line,
whether a recovery in place was under way, why the failure cannot be recovered in
place), then asks its rungs in order; the first that answers decides. A rung answers
with a ``Reaction``, a value: stop the run, or recover by one of three moves, each
followed by the rung's own step (``Reaction.then``), which returns what becomes of the
worker group (``GroupDecision``). The loop carries the move out and knows no rung by
name, so a new way to recover is a new rung, not a new branch in the loop.

The order ``launch.assemble`` gives the rungs:

1. the rules that end the run, which no recovery may override: no progress across the
   last restarts (``rungs.StallRung``), the same failure twice in a row
   (``rungs.CrashLoopRung``), and the job's restart budget (``rungs.BudgetRung``, which
   charges the failure to it);
2. in place (``inprocess.agent.rung.InPlaceRung``): the survivors keep their
   processes, the failed workers are replaced;
3. a group restart (``rungs.GroupRestartRung``): every worker starts again, as under
   torchrun. It always answers.

Between failures one part follows the workers (``Follower``: the in-place rung, which
leads its rounds): it answers the workers' questions on each pass of the loop, says
whether the workers stay when the group re-forms, and may start fresh workers in a
round of its own.

The path of one failure, in place, alone in the round::

    ElasticLoop._pass -> _after_failure(attempt, failed)
      Ladder.on_failure -> Failure(what, recovering=False, in_place=None)
        StallRung.decide -> None; CrashLoopRung.decide -> None
        BudgetRung.decide -> None (a restart taken from the budget)
        InPlaceRung.decide -> Reaction(IN_PLACE, then=recover_alone)
      ElasticLoop._carry_out: report.restart(in_place=True); then() -> GroupDecision.kept()

and as a group restart (a worker without ``elastrun.inprocess``)::

        InPlaceRung.decide -> None ("a failed worker did not use elastrun.inprocess")
        GroupRestartRung.decide -> Reaction(RESTART, then=own_failure, from_memory=N)
      ElasticLoop._carry_out: phase RESTARTING; report.restart(); then() -> restart_fresh
        -> stop the workers, a new round, start them again
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from elastrun.agent import failures
from elastrun.agent.attempt import Attempt
from elastrun.agent.plan import LaunchPlan
from elastrun.supervise.processes.procset import Exit

__all__ = [
    "Failure",
    "Follower",
    "GroupAction",
    "GroupDecision",
    "Ladder",
    "Move",
    "Reaction",
    "Rung",
]


class GroupAction(enum.Enum):
    KEPT = "kept"  # the workers run on, in place
    RESTART_IN_ROUND = "restart_in_round"  # restart them in the round already joined
    RESTART_FRESH = "restart_fresh"  # restart them in a new round


@dataclass(frozen=True)
class GroupDecision:
    """What the loop does with the worker group after a rung's step (``plan``: the
    round already joined, for ``RESTART_IN_ROUND``)."""

    action: GroupAction
    plan: LaunchPlan | None = None

    @classmethod
    def kept(cls) -> GroupDecision:
        return cls(GroupAction.KEPT)

    @classmethod
    def restart_in(cls, plan: LaunchPlan) -> GroupDecision:
        return cls(GroupAction.RESTART_IN_ROUND, plan)

    @classmethod
    def restart_fresh(cls) -> GroupDecision:
        return cls(GroupAction.RESTART_FRESH)


class Move(enum.Enum):
    """What the loop does before a rung's step."""

    STOP = "stop"  # none: the run ends with its failed result
    RESTART = "restart"  # enter RESTARTING: every worker is to start again
    IN_PLACE = "in_place"  # nothing: the workers run on while the step recovers them
    REJOIN = "rejoin"  # end the round, enter RENDEZVOUS: the step joins the next one


@dataclass(frozen=True)
class Reaction:
    """A rung's answer (a value; the loop carries it out).

    Attributes:
        move: see ``Move``.
        then: the rung's step, run by the loop after the move (None for ``STOP``).
        stalled: why the run stops for lack of progress across restarts (``STOP``).
        crash_loop: the crash loop that stops the run (``STOP``).
        from_memory: the step the restarted workers' state comes from, in the node's
            memory checkpoints (``RESTART``; None: none is held, or the workers do not
            use them), for the restart's report.
    """

    move: Move
    then: Callable[[], GroupDecision] | None = None
    stalled: str | None = None
    crash_loop: str | None = None
    from_memory: int | None = None

    @classmethod
    def stop(cls, *, stalled: str | None = None, crash_loop: str | None = None) -> Reaction:
        return cls(Move.STOP, stalled=stalled, crash_loop=crash_loop)

    @classmethod
    def restart(
        cls, then: Callable[[], GroupDecision], *, from_memory: int | None = None
    ) -> Reaction:
        return cls(Move.RESTART, then, from_memory=from_memory)

    @classmethod
    def in_place(cls, then: Callable[[], GroupDecision]) -> Reaction:
        return cls(Move.IN_PLACE, then)

    @classmethod
    def rejoin(cls, then: Callable[[], GroupDecision]) -> Reaction:
        return cls(Move.REJOIN, then)


@dataclass(frozen=True)
class Failure:
    """The facts of one failure, gathered once for every rung.

    Attributes:
        attempt: the attempt whose workers failed.
        failed: their exits, the first observed first (the root cause).
        what: the root cause in one line (rank and exit), for the budget's records.
        recovering: a recovery in place was under way when it came (the recovery is
            then judged when it completes, not now).
        in_place: why it cannot be recovered in place (None: it can).
    """

    attempt: Attempt
    failed: Sequence[Exit]
    what: str
    recovering: bool
    in_place: str | None


class Rung(Protocol):
    """One way of answering a failure."""

    def decide(self, failure: Failure) -> Reaction | None:
        """The answer, or None: the next rung is asked."""
        ...


class Follower(Protocol):
    """The part that follows the workers between failures (the in-place rung)."""

    def open(self) -> dict[str, str]:
        """Start following; the variables every worker gets from it."""
        ...

    def close(self) -> None: ...

    def assess(self, attempt: Attempt, failed: Sequence[Exit]) -> tuple[bool, str | None]:
        """For a failure: whether a recovery was under way (it is given up: the next
        one takes this failure in), and why the failure cannot be recovered in place."""
        ...

    def on_pass(self, attempt: Attempt) -> GroupDecision | None:
        """On each pass of the loop: what becomes of the group, or None (the pass goes
        on to look at the workers' exits)."""
        ...

    def wake_in(self) -> float | None:
        """Seconds until it has something to do (None: only when told)."""
        ...

    def on_reform(self, attempt: Attempt, why: str) -> Reaction:
        """The group re-forms (nodes wait to join): ``REJOIN`` keeps the workers
        running through it; ``RESTART`` stops and starts them in the next round."""
        ...

    def starting(self, plan: LaunchPlan, previous: Attempt | None) -> LaunchPlan:
        """The plan to start fresh workers with (they may join a round of its own)."""
        ...

    def started(self, attempt: Attempt) -> None: ...


class Ladder:
    """Asks its rungs in order; ``follower`` follows the workers between failures.

    Args:
        rungs: in the order they are asked; the last one always answers.
        follower: the part that follows the workers (see ``Follower``).
    """

    def __init__(self, rungs: Sequence[Rung], follower: Follower) -> None:
        self._rungs = tuple(rungs)
        self.follower = follower

    def on_failure(self, attempt: Attempt, failed: Sequence[Exit]) -> Reaction:
        """The first answer of the rungs to the failure of ``failed``."""
        recovering, in_place = self.follower.assess(attempt, failed)
        what = failures.describe_failure(attempt, failed[0])
        failure = Failure(attempt, failed, what, recovering, in_place)
        for rung in self._rungs:
            reaction = rung.decide(failure)
            if reaction is not None:
                return reaction
        raise AssertionError(f"no rung of {self!r} answered")  # (the last always does)

    def __repr__(self) -> str:
        names = ", ".join(type(r).__name__ for r in self._rungs)
        return f"Ladder([{names}])"
