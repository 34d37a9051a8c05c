"""Exclusion with a cool-down: strikes within a window, the verdict (never below the
minimum), the records, and the rounds that go on without an excluded node."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator

import pytest

from elastrun.agent.cooldown import CoolDown
from elastrun.core import cancel
from elastrun.core.errors import ConfigError, NodeExcludedError, ShutdownRequested
from elastrun.core.interrupt import Interruptible
from elastrun.core.shutdown import ShutdownRequest
from elastrun.observe.sinks import MemoryEventSink, NullMetricSink
from elastrun.rendezvous.decide import Joiner, RoundView, Verdict, decide_round
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.exclusion import (
    MAX_GROWTH,
    Exclusion,
    ExclusionRule,
    ExclusionVerdict,
    Strikes,
    check_failed,
    exclusion_verdict,
    load_exclusion,
    load_record,
    strikes_within,
)
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.api import EventKind, WatchEvent
from elastrun.store.memory import MemoryStore
from elastrun.testing import FakeClock

RULE = ExclusionRule(after=2, window=60.0, cooldown=30.0)


def test_strikes_count_only_within_the_window() -> None:
    assert strikes_within((10.0, 50.0, 100.0), 120.0, 60.0) == (100.0,)
    assert strikes_within((100.0, 120.0), 120.0, 60.0) == (100.0, 120.0)
    assert strikes_within((60.0,), 120.0, 60.0) == ()  # exactly a window old: gone


def test_a_node_is_excluded_at_the_limit_but_never_below_the_minimum() -> None:
    assert exclusion_verdict(1, RULE, others=3, min_nodes=2) is ExclusionVerdict.STAYS
    assert exclusion_verdict(2, RULE, others=2, min_nodes=2) is ExclusionVerdict.EXCLUDED
    assert exclusion_verdict(2, RULE, others=1, min_nodes=2) is ExclusionVerdict.KEPT_AT_MIN
    off = ExclusionRule()
    assert not off.enabled
    assert exclusion_verdict(9, off, others=9, min_nodes=1) is ExclusionVerdict.STAYS
    assert check_failed(others=1, min_nodes=1) is ExclusionVerdict.EXCLUDED
    assert check_failed(others=0, min_nodes=1) is ExclusionVerdict.KEPT_AT_MIN


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"after": -1}, "--exclude-after"), ({"window": 0.0}, "--exclude-window"),
     ({"cooldown": float("inf")}, "--exclude-cooldown")],
)  # fmt: skip
def test_a_bad_rule_names_its_option(fields: dict[str, float], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ExclusionRule(**fields)  # type: ignore[arg-type]  # floats for int and bool fields


def test_records_round_trip_and_the_cool_down_expires() -> None:
    record = Exclusion("n1", 1000.0, "its workers failed 2 times within 60s", "10.0.0.1")
    assert load_exclusion("n1", record.dump()) == record
    assert record.remaining(970.0) == 30.0 and record.remaining(1000.0) == 0.0
    assert load_exclusion("n1", b"not json") is None
    assert load_exclusion("n1", b'{"v": 99, "until": 1}') is None  # another version
    assert load_record(b'{"v": 1, "at": [1.5, true, "x", 2]}') == Strikes((1.5, 2.0))
    # A record of before the repeat count reads as never excluded.
    assert load_record(b'{"v": 1, "at": [3]}').repeats == 0
    strikes = Strikes((1.0,), repeats=2, back=50.0)
    assert load_record(strikes.dump()) == strikes


def _j(node: str, prev: int | None = None) -> Joiner:
    return Joiner(node, 0, prev)


KW = dict(max_nodes=2, now=0.0, call_started_at=0.0, last_call=30.0, join_deadline=600.0,
          first_round=False)  # fmt: skip


def test_a_spare_takes_an_excluded_members_place_at_once() -> None:
    # "b" is excluded (alive, sitting out its cool-down); the spare "s" waited for room.
    # arg-type: KW is a dict[str, float]; max_nodes takes an int, first_round a bool
    d = decide_round([_j("s"), _j("a", 0)], {"a", "b"}, min_nodes=1, excluded={"b"}, **KW)  # type: ignore[arg-type]
    assert d.verdict is Verdict.CLOSE and d.members == ("a", "s")
    # Below the maximum too: the round waits for every live member but the excluded one.
    # arg-type: KW is a dict[str, float]; max_nodes takes an int, first_round a bool
    d = decide_round([_j("a", 0)], {"a", "b"}, min_nodes=1, excluded={"b"}, **KW)  # type: ignore[arg-type]
    assert d.verdict is Verdict.CLOSE and d.members == ("a",)
    # arg-type: KW is a dict[str, float]; max_nodes takes an int, first_round a bool
    without = decide_round([_j("a", 0)], {"a", "b"}, min_nodes=1, **KW)  # type: ignore[arg-type]
    assert without.verdict is Verdict.WAIT


def test_an_excluded_joiner_waits_like_a_spare() -> None:
    # arg-type: KW is a dict[str, float]; max_nodes takes an int, first_round a bool
    d = decide_round([_j("a", 0), _j("b", 1)], {"a", "b"}, min_nodes=1, excluded={"b"}, **KW)  # type: ignore[arg-type]
    assert d.verdict is Verdict.CLOSE and d.members == ("a",)


def test_the_closer_follows_exclusions_from_events() -> None:
    keys = RunKeys("/elastrun/job/")
    view = RoundView(keys, 1, previous=("a", "b"))
    view.load({}, [keys.nodes + "a", keys.nodes + "b"], None, [keys.excluded("b")])
    assert view.excluded == {"b"}
    view.apply([WatchEvent(EventKind.DELETE, keys.excluded("b"), None, 0),
                WatchEvent(EventKind.PUT, keys.excluded("a"), b"{}", 0)])  # fmt: skip
    assert view.excluded == {"a"}


# --- in the store: the failing node decides, once, for the job ----------------------------


def _handler(
    store: MemoryStore, name: str, lo: int, hi: int, clock: FakeClock | None = None
) -> DynamicRendezvousHandler:
    # A long last call: a round that waited for an excluded node would not close in time.
    settings = RendezvousSettings("job", lo, hi, last_call_timeout=60.0)
    node = NodeDesc(name, "127.0.0.1", "default", 1)
    if clock is None:
        return DynamicRendezvousHandler(store, settings, node)
    return DynamicRendezvousHandler(store, settings, node, clock=clock)


def _join(handlers: list[DynamicRendezvousHandler]) -> list[int]:
    ranks: dict[int, int] = {}  # by the handler's place in ``handlers``

    def go(i: int, h: DynamicRendezvousHandler) -> None:
        ranks[i] = h.next_rendezvous().rank

    threads = [
        threading.Thread(target=go, args=(i, h), daemon=True) for i, h in enumerate(handlers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(ranks) == len(handlers), "the round did not close"
    return [ranks[i] for i in range(len(handlers))]


def test_two_strikes_exclude_a_node_and_the_others_go_on_without_it() -> None:
    store, clock = MemoryStore(), FakeClock()
    a, c = _handler(store, "a", 2, 3), _handler(store, "c", 2, 3)
    b = _handler(store, "b", 2, 3, clock)
    b.exclusions.set_rule(RULE)
    try:
        _join([a, b, c])
        assert b.outcome.report_failure(5, "rank 1 exited with code 1") is True
        assert b.exclusions.exclusion() is None  # one strike
        _join([a, b, c])
        clock.advance(10)
        assert b.outcome.report_failure(5, "rank 1 exited with code 1") is True
        excluded = b.exclusions.exclusion()
        assert excluded is not None and excluded.until == clock.time() + RULE.cooldown
        assert "failed 2 times within 60s" in excluded.reason
        assert [e.node for e in a.exclusions.excluded_nodes()] == ["b"]
        assert sorted(_join([a, c])) == [0, 1]  # at once: no one waits for "b"
        b.exclusions.readmit()
        assert b.exclusions.exclusion() is None and a.exclusions.excluded_nodes() == []
        # A failed node check feeds the same decision (the minimum still holds: a, b).
        checked = c.exclusions.exclude("its node check failed")
        assert checked is not None and [e.node for e in a.exclusions.excluded_nodes()] == ["c"]
        assert (
            c.exclusions.exclude("again") == checked
        )  # an exclusion that holds keeps its cool-down
        assert b.exclusions.wait_closed(0.01) is False
        a.set_closed("finished")
        assert b.exclusions.wait_closed(10) is True  # a node sitting out learns that the job ended
    finally:
        for h in (a, b, c):
            h.leave()


def test_a_repeat_offenders_cool_down_doubles_up_to_a_bound() -> None:
    assert [RULE.cooldown_after(n) for n in range(4)] == [30.0, 60.0, 120.0, 240.0]
    assert RULE.cooldown_after(99) == RULE.cooldown * MAX_GROWTH


def test_a_node_failing_again_after_its_readmission_goes_out_for_longer_at_no_cost() -> None:
    store, clock = MemoryStore(), FakeClock()
    a, c = _handler(store, "a", 2, 3), _handler(store, "c", 2, 3)
    b = _handler(store, "b", 2, 3, clock)
    b.exclusions.set_rule(RULE)
    try:
        _join([a, b, c])
        assert b.outcome.report_failure(5, "rank 1 exited with code 1") is True
        assert a.outcome.restarts_used() == 1  # the first strike is charged
        cooldowns, reasons = [], []
        for _ in range(3):  # excluded, readmitted at once, failing again: three times
            _join([a, b, c])
            clock.advance(1)
            assert b.outcome.report_failure(5, "rank 1 exited with code 1") is True
            excluded = b.exclusions.exclusion()
            assert excluded is not None
            cooldowns.append(excluded.until - clock.time())
            reasons.append(excluded.reason)
            clock.advance(cooldowns[-1])
            b.exclusions.readmit()
        assert cooldowns == [30.0, 60.0, 120.0]
        assert "excluded 3 times in a row, 120s this time" in reasons[-1]
        # The failures that excluded it cost the job no restart: the others went on
        # without it, as after the loss of a node.
        assert a.outcome.restarts_used() == 1
        # Healthy for a window after it came back: its next exclusion is the rule's again.
        clock.advance(RULE.window)
        for _ in range(2):
            _join([a, b, c])
            assert b.outcome.report_failure(5, "rank 1 exited with code 1") is True
            clock.advance(1)
        again = b.exclusions.exclusion()
        assert again is not None and again.until - clock.time() == 30.0 - 1
        assert a.outcome.restarts_used() == 2  # its first strike of the new window
        assert "in a row" not in again.reason
    finally:
        for h in (a, b, c):
            h.leave()


def test_a_node_stays_when_the_others_alone_are_below_the_minimum() -> None:
    store = MemoryStore()
    a, b = _handler(store, "a", 2, 2), _handler(store, "b", 2, 2)
    b.exclusions.set_rule(ExclusionRule(after=1))
    try:
        _join([a, b])
        assert b.outcome.report_failure(5, "rank 1 exited with code 1") is True
        assert b.exclusions.exclusion() is None
        kept = b.exclusions.take_kept_at_min()
        assert kept is not None and "without it 1 node(s) would remain (--nnodes minimum 2)" in kept
        assert b.exclusions.take_kept_at_min() is None  # said once
    finally:
        for h in (a, b):
            h.leave()


# --- the agent's side: sitting out the cool-down ------------------------------------------


class _Board:
    """The rendezvous' exclusions as the cool-down sees them: one record of this node."""

    def __init__(self, until: float) -> None:
        self.record: Exclusion | None = Exclusion("me", until, "its workers failed 2 times")
        self.kept: str | None = None

    def set_rule(self, rule: ExclusionRule) -> None:
        pass

    def take_kept_at_min(self) -> str | None:
        kept, self.kept = self.kept, None
        return kept

    def exclude(self, reason: str) -> Exclusion | None:
        raise AssertionError("the cool-down never excludes a node (the node check does)")

    def exclusion(self) -> Exclusion | None:
        return self.record

    def readmit(self) -> None:
        self.record = None

    def excluded_nodes(self) -> list[Exclusion]:
        return [self.record] if self.record is not None else []

    def wait_closed(self, timeout: float) -> bool:
        cancel.current().sleep(timeout)
        return False


class _Ticking(FakeClock):
    """Wall-clock time that moves one second each time it is read."""

    def time(self) -> float:
        self.advance(1.0)
        return super().time()


@pytest.fixture
def shutdown() -> Iterator[ShutdownRequest]:
    request = ShutdownRequest()
    yield request
    request.close()


def _cooldown(
    board: _Board, clock: FakeClock, shutdown: ShutdownRequest, events: MemoryEventSink
) -> CoolDown:
    return CoolDown(
        board,
        RULE,
        interruptible=Interruptible(shutdown),
        events=events,
        metrics=NullMetricSink(),
        clock=clock,
        line_every=0.001,
    )


def test_an_excluded_node_says_why_it_waits_then_rejoins(
    caplog: pytest.LogCaptureFixture, shutdown: ShutdownRequest
) -> None:
    clock, events = _Ticking(), MemoryEventSink()
    board = _Board(until=clock.time() + 4)
    board.kept = "an earlier failure, but it stays"
    caplog.set_level(logging.INFO, "elastrun.agent")
    _cooldown(board, clock, shutdown, events).before_round()
    lines = [r.getMessage() for r in caplog.records]
    waiting = [m for m in lines if "kept out of the job's rounds" in m]
    assert len(waiting) >= 2 and "(its workers failed 2 times): it rejoins in" in waiting[0]
    assert "this node's cool-down is over: it joins the job again" in lines
    assert board.record is None  # readmitted
    assert events.names() == ["agent.exclusion_skipped", "agent.excluded", "agent.readmitted"]


def test_a_signal_ends_the_cool_down_at_once(shutdown: ShutdownRequest) -> None:
    clock = FakeClock()  # the cool-down never ends by itself
    board = _Board(until=clock.time() + 3600)
    timer = threading.Timer(0.05, shutdown.scope.cancel, ("SIGTERM",))
    timer.start()
    try:
        with pytest.raises(ShutdownRequested) as stop:
            _cooldown(board, clock, shutdown, MemoryEventSink()).before_round()
    finally:
        timer.join()
    assert stop.value.signum == signal.SIGTERM
    assert board.record is not None  # still excluded: it did not rejoin


def test_with_the_rule_off_nothing_is_read(shutdown: ShutdownRequest) -> None:
    class _Untouchable:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"read {name} with the rule off")

    CoolDown(
        _Untouchable(),  # type: ignore[arg-type]  # a fake: any read fails the test
        ExclusionRule(),
        interruptible=Interruptible(shutdown),
        events=MemoryEventSink(),
        metrics=NullMetricSink(),
        clock=FakeClock(),
    ).before_round()


def test_with_exits_an_excluded_node_leaves_instead_of_waiting(shutdown: ShutdownRequest) -> None:
    clock, events = FakeClock(), MemoryEventSink()
    board = _Board(until=clock.time() + 3600)
    cooldown = CoolDown(
        board,
        ExclusionRule(after=1, exits=True),
        interruptible=Interruptible(shutdown),
        events=events,
        metrics=NullMetricSink(),
        clock=clock,
    )
    with pytest.raises(NodeExcludedError, match="exit status 75"):
        cooldown.before_round()
    assert events.names() == ["agent.excluded"]
