"""No progress across restarts: stop after N attempts in a row in which no rank passed its best."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError
from elastrun.pace import NoProgressGuard, ProgressRecord, steps_of


def test_the_same_crash_at_the_same_step_three_times_stops() -> None:
    guard = NoProgressGuard()
    assert not guard.attempt_ended({0: 500, 1: 500})  # the first attempt sets the bar
    assert not guard.attempt_ended({0: 450, 1: 450})  # resumed at 400, died at 450
    assert not guard.attempt_ended({0: 450, 1: 449})
    assert guard.attempt_ended({0: 500, 1: 500})  # equal is not passing
    assert guard.should_stop
    assert guard.stalled == 3
    assert guard.describe() == (
        "3 consecutive attempt(s) without progress (limit 3); best steps: rank 0: 500, "
        "rank 1: 500; last attempt: rank 0: 500, rank 1: 500"
    )


def test_one_rank_passing_its_best_is_progress_and_resets_the_count() -> None:
    guard = NoProgressGuard(limit=2)
    guard.attempt_ended({0: 100, 1: 100})
    assert not guard.attempt_ended({0: 90, 1: 90})
    assert not guard.attempt_ended({0: 90, 1: 101})
    assert guard.stalled == 0
    assert guard.best == {0: 100, 1: 101}
    assert not guard.attempt_ended({0: 95, 1: 95})
    assert guard.attempt_ended({0: 95, 1: 95})


def test_a_job_that_never_reports_is_never_stopped() -> None:
    guard = NoProgressGuard(limit=1)
    for _ in range(10):
        assert not guard.attempt_ended({})
    assert guard.describe().endswith("best steps: none; last attempt: no reports")


def test_once_reports_came_an_attempt_without_any_is_no_progress() -> None:
    guard = NoProgressGuard(limit=2)
    guard.attempt_ended({0: 10})
    assert not guard.attempt_ended({})  # crashed before its first step
    assert guard.attempt_ended({})


def test_a_rank_seen_for_the_first_time_counts_as_progress() -> None:
    guard = NoProgressGuard(limit=1)
    guard.attempt_ended({0: 10})
    assert not guard.attempt_ended({0: 5, 1: 0})  # the job grew: rank 1 is new


def test_steps_of_a_snapshot() -> None:
    snapshot = {2: ProgressRecord(7, 0.0, None, None, 1, 9)}
    assert steps_of(snapshot) == {2: 7}


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_a_limit_that_is_not_a_positive_integer_is_refused(limit: object) -> None:
    with pytest.raises(ConfigError):
        NoProgressGuard(limit)  # type: ignore[arg-type]  # bad values, refused at run time


attempts = st.lists(
    st.dictionaries(st.integers(0, 3), st.integers(0, 20), max_size=4), min_size=1, max_size=12
)


@given(attempts=attempts, limit=st.integers(1, 4))
def test_stop_exactly_when_the_last_limit_attempts_passed_no_earlier_best(
    attempts: list[dict[int, int]], limit: int
) -> None:
    guard = NoProgressGuard(limit)
    best: dict[int, int] = {}
    stalled = 0
    for steps in attempts:
        decision = guard.attempt_ended(steps)
        if best or steps:
            passed = any(s > best.get(r, -1) for r, s in steps.items())
            stalled = 0 if passed else stalled + 1
            for r, s in steps.items():
                best[r] = max(best.get(r, -1), s)
        assert decision == (stalled >= limit)
    assert guard.best == best
