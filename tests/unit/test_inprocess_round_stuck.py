"""Which kept workers the round under way finds stuck, and when: any that has not come
at the join bound, and one blocked for good in a gloo collective ``SURE_AFTER`` seconds
into the round, at every look for ``CONFIRM`` seconds (the probe stood in for)."""

from __future__ import annotations

from elastrun.core.tcp_sockets import Endpoints
from elastrun.inprocess.agent.round import InprocessRound
from elastrun.inprocess.agent.stuck import CONFIRM, SURE_AFTER
from elastrun.observe.sinks import MemoryEventSink, NullMetricSink
from elastrun.testing import FakeClock


class _Hub:
    def __init__(self) -> None:
        self.came: set[int] = set()

    def joined(self, local_rank: int, pid: int, round_no: int) -> bool:
        return local_rank in self.came

    def synced(self, local_rank: int, pid: int, round_no: int) -> bool:
        return False


def _round(
    join_timeout: float, blocked_pids: set[int]
) -> tuple[InprocessRound, _Hub, FakeClock, list[tuple[int, Endpoints]]]:
    """A round of local ranks 0-2 kept (pids 100-102) and 3 replaced (pid 103); the probe
    finds ``blocked_pids`` blocked (a set the test may change between looks)."""
    hub, clock = _Hub(), FakeClock()
    asked: list[tuple[int, Endpoints]] = []

    def blocked(pid: int, peers: Endpoints) -> bool:
        asked.append((pid, peers))
        return pid in blocked_pids

    current = InprocessRound(
        lambda: hub,  # type: ignore[arg-type,return-value]  # (a stand-in for the hub)
        clock,
        MemoryEventSink(),
        NullMetricSink(),
        timeout=60.0,
        join_timeout=join_timeout,
        blocked=blocked,
    )
    current.begin(
        1, {0: 100, 1: 101, 2: 102, 3: 103}, {3: 103}, after_failure=True, cut=["0100007F:1F90"]
    )
    return current, hub, clock, asked


def test_a_worker_blocked_for_good_is_stuck_soon_and_the_others_only_at_the_join_bound() -> None:
    blocked = {101, 102, 103}
    current, hub, clock, asked = _round(30.0, blocked)
    hub.came.add(0)
    clock.advance(SURE_AFTER - CONFIRM - 0.1)
    assert current.stuck() == [] and asked == []  # too soon to tell: the cut may be at work
    clock.advance(0.2)
    assert current.stuck() == []  # ranks 1 and 2 found blocked once: not yet sure
    # Rank 3 is a replacement (never asked); rank 0 came.
    assert sorted(pid for pid, _ in asked) == [101, 102]
    assert all("0100007F:1F90" in peers for _, peers in asked)  # the round's listeners
    blocked.discard(102)  # rank 2's wait ended (gloo failed its collective, say)
    clock.advance(CONFIRM / 2)
    assert current.stuck() == []
    blocked.add(102)  # and it waits again: found so since now only
    clock.advance(CONFIRM / 2)
    assert current.stuck() == [1]  # blocked at every look over CONFIRM seconds
    clock.advance(CONFIRM)
    assert current.stuck() == [1, 2]
    clock.advance(30.0)
    blocked.clear()
    assert current.stuck() == [1, 2]  # the join bound: whoever has not come


def test_a_join_bound_shorter_than_the_probe_wait_decides_alone() -> None:
    current, _hub, clock, asked = _round(1.0, blocked_pids=set())
    clock.advance(1.0)
    assert current.stuck() == [0, 1, 2] and asked == []
