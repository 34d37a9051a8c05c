"""Hang verdicts from progress snapshots: fixed and automatic timeouts, with a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError
from elastrun.pace import (
    AutoTimeout,
    HangDetector,
    ProgressRecord,
    parse_hang_timeout,
)
from elastrun.testing import FakeClock


def rec(
    step: int,
    last: float,
    *,
    step_time: float | None = 0.1,
    longest: float | None = 0.2,
    reports: int = 100,
) -> ProgressRecord:
    return ProgressRecord(step, last, step_time, longest, reports, pid=1000 + step)


def test_no_snapshot_or_no_armed_rank_is_never_hung() -> None:
    clock = FakeClock()
    detector = HangDetector(10.0, clock)
    assert detector.check({}) is None
    clock.advance(1e6)
    # A rank that never reported is simply absent from a snapshot: never hung.
    assert detector.check({}) is None


def test_a_rank_silent_for_the_timeout_is_hung_and_not_a_moment_before() -> None:
    clock = FakeClock(start=100.0)
    detector = HangDetector(60.0, clock)
    snapshot = {0: rec(7, 100.0), 1: rec(8, 130.0)}
    clock.advance(59.999)
    assert detector.check(snapshot) is None
    clock.advance(0.001)
    verdict = detector.check(snapshot)
    assert verdict is not None
    assert verdict.hung == (0,)
    assert [(r.local_rank, r.step) for r in verdict.ranks] == [(0, 7), (1, 8)]
    assert [r.silent_for for r in verdict.ranks] == pytest.approx([60.0, 30.0])
    assert verdict.at == 160.0


def test_the_verdict_names_the_rank_that_stopped_first_and_everyones_last_step() -> None:
    # Rank 2 stopped at step 40; the others went on to 42 and then waited for it.
    snapshot = {0: rec(42, 1010.0), 1: rec(42, 1010.05), 2: rec(40, 1009.7)}
    verdict = HangDetector(30.0).check(snapshot, now=1100.0)
    assert verdict is not None
    assert verdict.stopped_first == (2,)
    assert verdict.hung == (2, 0, 1)
    text = verdict.describe()
    assert "no progress from local rank(s) 2, 0, 1; stopped first: 2;" in text
    assert "local rank 2: step 40, silent 90.3 s (timeout 30 s)" in text


def test_ranks_that_stopped_within_half_a_step_of_each_other_all_stopped_first() -> None:
    # One synchronous job: every rank's last report is the same step, a jitter apart.
    snapshot = {0: rec(9, 500.00, step_time=0.2), 1: rec(9, 500.08, step_time=0.2)}
    verdict = HangDetector(5.0).check(snapshot, now=600.0)
    assert verdict is not None
    assert verdict.stopped_first == (0, 1)


def test_check_reads_the_injected_clock_unless_given_now() -> None:
    clock = FakeClock(start=0.0)
    detector = HangDetector(10.0, clock)
    snapshot = {3: rec(1, 0.0)}
    assert detector.check(snapshot) is None
    assert detector.check(snapshot, now=10.0) is not None
    clock.advance(11.0)
    assert detector.check(snapshot) is not None


def test_auto_uses_the_warmup_floor_for_the_first_reports() -> None:
    auto = AutoTimeout()
    detector = HangDetector(auto)
    young = rec(3, 0.0, longest=0.5, reports=auto.warmup_reports - 1)
    grown = young._replace(reports=auto.warmup_reports)
    assert detector.timeout_for(young) == auto.warmup_floor == 1800.0
    assert detector.timeout_for(grown) == auto.floor == 600.0
    assert detector.check({0: young}, now=1799.0) is None
    assert detector.check({0: grown}, now=1799.0) is not None


def test_auto_tolerates_a_periodic_checkpoint_it_has_seen() -> None:
    # A 5-minute save was seen once: the next one, even a little slower, is no hang.
    auto = AutoTimeout()
    record = rec(1000, 0.0, step_time=0.05, longest=300.0)
    assert auto.timeout_for(record) == 900.0
    assert HangDetector(auto).check({0: record}, now=400.0) is None
    assert HangDetector(auto).check({0: record}, now=900.0) is not None


def test_auto_before_two_reports_has_no_history_and_uses_the_floor() -> None:
    only_one = ProgressRecord(1, 0.0, None, None, 1, 5)
    assert AutoTimeout().timeout_for(only_one) == 1800.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", AutoTimeout()), (" AUTO ", AutoTimeout()), ("90", 90.0), ("0.5", 0.5)],
)
def test_parse_hang_timeout_accepts_seconds_or_auto(text: str, expected: object) -> None:
    assert parse_hang_timeout(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "soon", "", "1e9"])
def test_parse_hang_timeout_refuses_anything_else_naming_the_option(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hang_timeout(text)
    assert str(info.value).startswith("--hang-timeout: must be a number of seconds > 0")
    assert "or auto" in str(info.value)


@pytest.mark.parametrize(
    "kwargs", [{"floor": 0}, {"warmup_floor": float("nan")}, {"warmup_reports": 0}, {"factor": 0.5}]
)
def test_auto_timeout_refuses_values_that_would_defeat_it(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        AutoTimeout(**kwargs)  # type: ignore[arg-type]  # dict[str, float] for an int field


def test_a_detector_refuses_a_non_positive_timeout() -> None:
    with pytest.raises(ConfigError, match="--hang-timeout"):
        HangDetector(0.0)


records = st.builds(
    ProgressRecord,
    step=st.integers(0, 10**6),
    last_report=st.floats(0.0, 1e4),
    step_time=st.none() | st.floats(1e-4, 10.0),
    longest=st.none() | st.floats(1e-4, 1e3),
    reports=st.integers(1, 100),
    pid=st.integers(1, 10**6),
)


@given(
    snapshot=st.dictionaries(st.integers(0, 15), records, max_size=8),
    now=st.floats(0.0, 2e4),
    timeout=st.none() | st.floats(0.1, 5e3),
)
def test_a_verdict_exists_exactly_when_some_rank_is_past_its_timeout(
    snapshot: dict[int, ProgressRecord], now: float, timeout: float | None
) -> None:
    detector = HangDetector(AutoTimeout() if timeout is None else timeout)
    verdict = detector.check(snapshot, now=now)
    expected = {
        r for r, x in snapshot.items() if max(0.0, now - x.last_report) >= detector.timeout_for(x)
    }
    if not expected:
        assert verdict is None
        return
    assert verdict is not None
    assert set(verdict.hung) == expected
    assert {r.local_rank for r in verdict.ranks} == set(snapshot)
    silences = [r.silent_for for r in verdict.ranks]
    assert silences == sorted(silences, reverse=True)
    earliest = min(x.last_report for x in snapshot.values())
    assert verdict.stopped_first[0] == verdict.ranks[0].local_rank
    assert snapshot[verdict.stopped_first[0]].last_report == earliest
