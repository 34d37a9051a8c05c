"""The recovery ladder: the facts of a failure gathered once, the rungs asked in order
(the first answer wins), and the stop rules ahead of every recovery."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from elastrun.agent.attempt import Attempt
from elastrun.agent.ladder import Failure, GroupDecision, Ladder, Move, Reaction
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.rungs import GroupRestartRung, StallRung
from elastrun.observe.sinks import MemoryEventSink
from elastrun.supervise.processes.procset import Exit


class _Attempt:
    """The part of an attempt a failure's line reads."""

    def global_rank(self, local_rank: int) -> int:
        return 10 + local_rank


class _Follower:
    def __init__(self, recovering: bool, in_place: str | None) -> None:
        self.assessed = 0
        self._answer = (recovering, in_place)

    def open(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass

    def assess(self, attempt: Attempt, failed: Sequence[Exit]) -> tuple[bool, str | None]:
        self.assessed += 1
        return self._answer

    def on_pass(self, attempt: Attempt) -> GroupDecision | None:
        return None

    def wake_in(self) -> float | None:
        return None

    def on_reform(self, attempt: Attempt, why: str) -> Reaction:
        return Reaction.restart(GroupDecision.restart_fresh)

    def starting(self, plan: LaunchPlan, previous: Attempt | None) -> LaunchPlan:
        return plan

    def started(self, attempt: Attempt) -> None:
        pass


class _Rung:
    def __init__(self, name: str, answer: Reaction | None, asked: list[str]) -> None:
        self._name, self._answer, self._asked = name, answer, asked
        self.seen: list[Failure] = []

    def decide(self, failure: Failure) -> Reaction | None:
        self._asked.append(self._name)
        self.seen.append(failure)
        return self._answer


EXITS = [Exit(local_rank=1, pid=42, exitcode=-9, observed_at=0.0)]


def _attempt() -> Any:
    return _Attempt()


def test_the_rungs_are_asked_in_order_and_the_first_answer_wins() -> None:
    asked: list[str] = []
    stop = _Rung("stop", None, asked)
    in_place = _Rung("in place", Reaction.in_place(GroupDecision.kept), asked)
    group = _Rung("group", Reaction.restart(GroupDecision.restart_fresh), asked)
    follower = _Follower(recovering=False, in_place=None)
    reaction = Ladder([stop, in_place, group], follower).on_failure(_attempt(), EXITS)
    assert reaction.move is Move.IN_PLACE
    assert asked == ["stop", "in place"]  # the group restart was not asked
    # One failure, its facts gathered once, the same value for every rung.
    assert follower.assessed == 1
    assert stop.seen == in_place.seen
    (failure,) = stop.seen
    assert failure.what == "rank 11 (local 1) was killed by SIGKILL"
    assert failure.in_place is None and not failure.recovering


def test_a_stop_rule_ahead_of_the_recoveries_ends_the_run() -> None:
    asked: list[str] = []
    rungs = [
        _Rung("budget", Reaction.stop(), asked),
        _Rung("in place", Reaction.in_place(GroupDecision.kept), asked),
    ]
    reaction = Ladder(rungs, _Follower(False, None)).on_failure(_attempt(), EXITS)
    assert reaction.move is Move.STOP and asked == ["budget"]


def test_a_ladder_whose_rungs_all_pass_is_a_bug() -> None:
    ladder = Ladder([_Rung("none", None, [])], _Follower(False, None))
    with pytest.raises(AssertionError, match="no rung"):
        ladder.on_failure(_attempt(), EXITS)


class _Progress:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def stalled(self) -> str | None:
        self.asked.append("restarts")
        return "3 restarts in a row made no progress"

    def stalled_in_place(self) -> str | None:
        self.asked.append("in place")
        return None


@pytest.mark.parametrize(
    ("recovering", "in_place", "asked", "stops"),
    [
        (True, None, [], False),  # judged when the recovery under way completes
        (False, None, ["in place"], False),  # by the commits the recoveries restored
        (False, "a worker did not use elastrun.inprocess", ["restarts"], True),
    ],
)
def test_the_stall_rule_judges_a_failure_by_how_it_will_be_recovered(
    recovering: bool, in_place: str | None, asked: list[str], stops: bool
) -> None:
    progress, events = _Progress(), MemoryEventSink()
    rung = StallRung(progress, events)  # type: ignore[arg-type]  # the part it reads
    failure = Failure(_attempt(), EXITS, "rank 11", recovering, in_place)
    reaction = rung.decide(failure)
    assert progress.asked == asked
    assert (reaction is not None and reaction.move is Move.STOP) is stops
    if stops:
        assert reaction is not None and reaction.stalled == "3 restarts in a row made no progress"
        assert events.names() == ["agent.no_progress"]


def test_the_group_restart_always_answers_and_checks_the_node_first() -> None:
    class _Check:
        def __init__(self) -> None:
            self.told = 0

        def own_failure(self) -> None:
            self.told += 1

    check = _Check()
    rung = GroupRestartRung(check)  # type: ignore[arg-type]  # the part it calls
    reaction = rung.decide(Failure(_attempt(), EXITS, "rank 11", False, "off"))
    assert reaction.move is Move.RESTART and check.told == 0  # (the loop records first)
    assert reaction.then is not None and reaction.then() == GroupDecision.restart_fresh()
    assert check.told == 1
