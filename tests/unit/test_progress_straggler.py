"""Straggler detection over windows of step times: per rank, and per node summaries."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError
from elastrun.pace import (
    NodeSummary,
    ProgressRecord,
    StragglerDetector,
    step_times,
    summarize,
)


def feed(
    detector: StragglerDetector[int], times: dict[int, float], windows: int, start: float = 0.0
) -> list[list[int]]:
    """Observe ``times`` once per second for ``windows`` windows; keys reported per window.

    The last observation (at ``start + windows * window``) closes the last window and is
    the first of the next one, where a following ``feed`` from that time goes on.
    """
    width = int(detector.window)
    reported = []
    for k in range(windows * width + 1):
        new = [s.key for s in detector.observe(times, start + k)]
        if k and k % width == 0:
            reported.append(new)
        else:
            assert new == []
    return reported


def test_a_rank_slower_than_its_peers_for_three_windows_is_reported_once() -> None:
    detector: StragglerDetector[int] = StragglerDetector(factor=1.5, windows=3, window=10.0)
    times = {0: 0.10, 1: 0.11, 2: 0.10, 3: 0.25}
    assert feed(detector, times, 5) == [[], [], [3], [], []]
    (straggler,) = detector.stragglers.values()
    assert straggler.key == 3
    assert straggler.peer_median == pytest.approx(0.10)
    assert straggler.ratio == pytest.approx(2.5)
    assert straggler.windows == 5
    assert "2.50x its peers' median" in straggler.describe()


def test_one_slow_window_is_not_a_straggler() -> None:
    detector: StragglerDetector[int] = StragglerDetector(windows=3, window=10.0)
    assert feed(detector, {0: 0.1, 1: 0.1, 2: 0.5}, 2) == [[], []]
    assert feed(detector, {0: 0.1, 1: 0.1, 2: 0.1}, 1, start=20.0) == [[]]
    assert feed(detector, {0: 0.1, 1: 0.1, 2: 0.5}, 2, start=30.0) == [[], []]
    assert detector.stragglers == {}


def test_a_straggler_that_keeps_up_again_is_cleared_and_can_be_reported_again() -> None:
    detector: StragglerDetector[int] = StragglerDetector(windows=2, window=5.0)
    assert feed(detector, {0: 0.1, 1: 0.3}, 2) == [[], [1]]
    feed(detector, {0: 0.1, 1: 0.1}, 1, start=10.0)
    assert detector.stragglers == {}
    assert feed(detector, {0: 0.1, 1: 0.3}, 2, start=15.0) == [[], [1]]


def test_a_window_averages_its_observations() -> None:
    detector: StragglerDetector[int] = StragglerDetector(factor=1.5, windows=1, window=10.0)
    # Rank 1 is slow in one observation out of ten: its window mean stays close to peers.
    found = []
    for second in range(11):
        slow = 0.5 if second == 5 else 0.1
        found += detector.observe({0: 0.1, 1: slow, 2: 0.1}, float(second))
    assert found == []
    # Slow in every observation: it is.
    for second in range(11, 21):
        found += detector.observe({0: 0.1, 1: 0.5, 2: 0.1}, float(second))
    assert [s.key for s in found] == [1]


def test_ranks_without_a_step_time_and_lone_ranks_are_never_stragglers() -> None:
    detector: StragglerDetector[int] = StragglerDetector(windows=1, window=1.0)
    assert detector.observe({0: None, 1: 5.0}, 0.0) == []
    assert detector.observe({0: None, 1: 5.0}, 1.0) == []  # no peer with a time
    lonely: StragglerDetector[int] = StragglerDetector(windows=1, window=1.0, min_peers=2)
    lonely.observe({0: 0.1, 1: 0.9}, 0.0)
    assert lonely.observe({0: 0.1, 1: 0.9}, 1.0) == []


def test_a_rank_absent_for_a_window_forgets_its_streak() -> None:
    detector: StragglerDetector[int] = StragglerDetector(windows=2, window=1.0)
    everyone = {0: 0.1, 1: 0.1, 2: 0.9}
    without = {0: 0.1, 1: 0.1}
    found = [
        [s.key for s in detector.observe(times, float(t))]
        for t, times in enumerate([everyone, without, everyone, everyone, everyone])
    ]
    # Window [0, 1): rank 2 slow; [1, 2): absent, so [2, 3) starts its count again.
    assert found == [[], [], [], [], [2]]


def _record(step_time: float | None) -> ProgressRecord:
    return ProgressRecord(10, 0.0, step_time, step_time, 10, 1)


def test_step_times_and_summaries_of_a_snapshot() -> None:
    snapshot = {0: _record(0.1), 1: _record(0.4), 2: _record(None), 3: _record(0.2)}
    assert step_times(snapshot) == {0: 0.1, 1: 0.4, 3: 0.2}
    assert summarize("node-a", step_times(snapshot)) == NodeSummary("node-a", 3, 0.4, 0.2, 1)
    assert summarize("node-b", step_times({0: _record(None)})) is None
    # An even count's median is the mean of the middle two; the slowest's global rank.
    four = {0: 0.1, 1: 0.4, 2: 0.3, 3: 0.2}
    assert summarize("n", four, {1: 9}) == NodeSummary("n", 4, 0.4, 0.25, 9)


def test_job_wide_detection_over_node_summaries() -> None:
    detector: StragglerDetector[str] = StragglerDetector(windows=2, window=1.0)
    nodes = [
        NodeSummary("a", 8, 0.10, 0.10, 0),
        NodeSummary("b", 8, 0.11, 0.10, 3),
        NodeSummary("c", 8, 0.30, 0.12, 5),
    ]
    found = []
    for second in range(4):
        found += detector.observe_nodes(nodes, float(second))
    assert [s.key for s in found] == ["c"]


@pytest.mark.parametrize(
    "kwargs", [{"factor": 1.0}, {"windows": 0}, {"window": 0.0}, {"min_peers": 0}]
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        StragglerDetector(**kwargs)  # type: ignore[arg-type]  # dict[str, float] for int fields


@given(
    time=st.floats(1e-3, 10.0),
    ranks=st.integers(2, 16),
    windows=st.integers(1, 5),
)
def test_ranks_with_equal_step_times_are_never_stragglers(
    time: float, ranks: int, windows: int
) -> None:
    detector: StragglerDetector[int] = StragglerDetector(windows=windows, window=1.0)
    for second in range(3 * windows + 1):
        assert detector.observe(dict.fromkeys(range(ranks), time), float(second)) == []
