"""The joining protocol without a store: each test drives it by hand, answering every
operation it asks for with a chosen result, on a clock that moves only when told.

A store-backed handler runs the same protocol (``DynamicRendezvousHandler._perform``);
these tests pin what the protocol asks and decides, one answer at a time.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousTimeoutError,
    StoreCompactedError,
)
from elastrun.rendezvous import joining as j
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.settings import RendezvousSettings
from elastrun.store.api import EventKind, WatchEvent, WatchResult
from elastrun.testing import FakeClock

KEYS = RunKeys("/elastrun/job/")
INFO = {"addr": "10.0.0.2", "role": "default", "local_world_size": 2}


def _ctx(clock: FakeClock, lo: int = 1, hi: int = 1, node: str = "b") -> j.Context:
    return j.Context(
        keys=KEYS, node_id=node, info=INFO, bounds=RendezvousSettings("job", lo, hi),
        join_timeout=60.0, run_id="job", clock=clock, new_port=lambda: 29500,
        progress_every=5.0, audit_every=30.0, follow_every=5.0,
    )  # fmt: skip


class Driver:
    """Steps a protocol: ``expect`` checks the next operation, ``answer`` sends its
    result; ``finish`` returns what the protocol returned."""

    def __init__(self, protocol: j.Protocol) -> None:
        self.protocol = protocol
        self.op: j.Op | j.Finished = j.advance(protocol, None, None)

    def expect(self, kind: type[Any], answer: Any = None) -> Any:
        op = self.op
        assert isinstance(op, kind), op
        self.op = j.advance(self.protocol, answer, None)
        return op

    def fail(self, kind: type[Any], error: BaseException) -> Any:
        op = self.op
        assert isinstance(op, kind), op
        self.op = j.advance(self.protocol, None, error)
        return op

    def finish(self) -> Any:
        assert isinstance(self.op, j.Finished), self.op
        return self.op.value


def _event(kind: EventKind, key: str, value: bytes | None, rev: int) -> WatchEvent:
    return WatchEvent(kind, key, value, rev)


def _view_reads() -> list[object]:
    """The answers to a closer's reads of round 0 where only "b" joined and lives."""
    return [({KEYS.join_prefix(0) + "b": b"{}"}, 9), ({KEYS.nodes + "b": b"{}"}, 9), ({}, 9), None]


def _result(size: int = 1) -> bytes:
    return json.dumps({"id": "d1", "size": size, "shape": [], "rev": 3}).encode()


def test_a_follower_shows_the_closers_progress_each_period_and_takes_the_result() -> None:
    clock = FakeClock()
    run = Driver(j.join_round(_ctx(clock), 0, None, clock.monotonic() + 60))
    run.expect(j.GetPrefix, ({KEYS.closer(0): b"a"}, 7))  # "a" decides the round
    put = run.expect(j.Put, 1)
    assert put.key == KEYS.join_prefix(0) + "b" and put.leased
    assert json.loads(put.value) == {**INFO, "prev_rank": None}
    clock.advance(5.0)  # the watch ends after its timeout, with nothing new
    watch = run.expect(j.Watch, WatchResult((), 8))
    assert (watch.prefix, watch.after) == (KEYS.out(0), 7)
    assert watch.timeout == pytest.approx(5.01)  # until the next progress line
    # A period passed: the follower reads the closer's status and shows it.
    assert run.expect(j.Get, None).key == KEYS.closed
    status = {"joined": 1, "timeout_in": 55.0}
    assert run.expect(j.Get, json.dumps(status).encode()).key == KEYS.status(0)
    assert run.expect(j.Progress) == j.Progress(0, status)
    watch = run.expect(
        j.Watch, WatchResult((_event(EventKind.PUT, KEYS.result(0), _result(), 9),), 9)
    )
    assert watch.after == 8
    assert run.finish()[0]["id"] == "d1"


def test_a_follower_takes_over_when_the_closers_claim_vanishes_and_closes_the_round() -> None:
    clock = FakeClock()
    run = Driver(j.join_round(_ctx(clock), 0, 4, clock.monotonic() + 60))
    run.expect(j.GetPrefix, ({KEYS.closer(0): b"a"}, 7))
    run.expect(j.Put, 1)
    gone = _event(EventKind.DELETE, KEYS.closer(0), None, 8)  # "a"'s lease ended
    run.expect(j.Watch, WatchResult((gone,), 8))
    claim = run.expect(j.CompareSet, (True, None))
    assert (claim.key, claim.expected, claim.value, claim.leased) == (
        KEYS.closer(0), None, b"b", True,
    )  # fmt: skip
    # As the closer: the view of round 0 from full reads.
    joined = json.dumps({**INFO, "prev_rank": 4}).encode()
    # (joins, live nodes, nobody sits out a cool-down, the run is not closed: at once)
    reads = run.expect(
        j.ReadAll, [({KEYS.join_prefix(0) + "b": joined}, 9), ({KEYS.nodes + "b": b"{}"}, 9),
                    ({}, 9), None],
    ).reads  # fmt: skip
    assert [r.prefix if isinstance(r, j.GetPrefix) else r.key for r in reads] == [
        KEYS.join_prefix(0), KEYS.nodes, KEYS.excluded_prefix, KEYS.closed,
    ]  # fmt: skip
    assert run.expect(j.Seen) == j.Seen(0, 1)
    # One node of 1..1: the round closes at once, with "b" at rank 0.
    pages = run.expect(j.PutAll).items  # one page: "b" at rank 0, with its address
    assert [key.rsplit("/", 1)[1] for key, _ in pages] == ["0"]
    assert pages[0][0].startswith(KEYS.prefix + "rounds/0/members/")
    assert json.loads(pages[0][1]) == {"members": {"b": [0, "10.0.0.2", "default", 2]}}
    result = run.expect(j.CompareSet, (True, None))
    assert result.key == KEYS.result(0)
    assert run.expect(j.Put, 12).key == KEYS.current
    assert run.expect(j.Closed) == j.Closed(0, 1)
    assert run.finish()[0]["size"] == 1


def test_a_follower_past_its_deadline_audits_the_round_and_times_out_below_the_minimum() -> None:
    clock = FakeClock()
    run = Driver(j.join_round(_ctx(clock, lo=2, hi=3), 0, None, clock.monotonic() + 8))
    run.expect(j.GetPrefix, ({KEYS.closer(0): b"a"}, 7))
    run.expect(j.Put, 1)
    clock.advance(5.0)
    run.expect(j.Watch, WatchResult((), 7))
    run.expect(j.Get, None)
    run.expect(j.Get, None)  # no status from the closer yet
    assert run.expect(j.Progress) == j.Progress(0, None)
    clock.advance(3.0)
    watch = run.expect(j.Watch, WatchResult((), 7))
    assert watch.timeout == pytest.approx(3.01)  # until the deadline, not a period
    # The closer decided nothing by the deadline: this node looks for itself.
    with pytest.raises(RendezvousTimeoutError, match="1 node"):
        run.expect(j.ReadAll, _view_reads())


def test_a_follower_stops_waiting_when_the_run_is_closed() -> None:
    clock = FakeClock()
    run = Driver(j.join_round(_ctx(clock), 0, None, clock.monotonic() + 60))
    run.expect(j.GetPrefix, ({KEYS.closer(0): b"a"}, 7))
    run.expect(j.Put, 1)
    clock.advance(5.0)
    run.expect(j.Watch, WatchResult((), 7))
    with pytest.raises(RendezvousClosedError, match="finished"):
        run.expect(j.Get, b"finished")


def test_a_compacted_history_is_read_again_in_full() -> None:
    clock = FakeClock()
    run = Driver(j.join_round(_ctx(clock), 0, None, clock.monotonic() + 60))
    run.expect(j.GetPrefix, ({KEYS.closer(0): b"a"}, 7))
    run.expect(j.Put, 1)
    run.fail(j.Watch, StoreCompactedError("compacted"))
    run.expect(j.GetPrefix, ({KEYS.closer(0): b"a", KEYS.result(0): _result()}, 20))
    assert run.finish()[0]["id"] == "d1"


def test_the_closer_publishes_its_progress_for_the_others_each_period() -> None:
    clock = FakeClock()
    run = Driver(j.join_round(_ctx(clock, lo=2, hi=3), 0, None, clock.monotonic() + 60))
    run.expect(j.GetPrefix, ({}, 7))  # nobody decides round 0 yet
    run.expect(j.Put, 1)
    run.expect(j.CompareSet, (True, None))
    run.expect(j.ReadAll, _view_reads())
    assert run.expect(j.Seen) == j.Seen(0, 1)
    for _ in range(2):  # at once, then a period later
        assert run.expect(j.Get, None).key == KEYS.result(0)  # not closed by an audit
        status = run.expect(j.Put, 10)
        assert status.key == KEYS.status(0)
        shown = json.loads(status.value)
        assert shown["joined"] == 1 and shown["last_call_in"] is None
        assert run.expect(j.Progress) == j.Progress(0, shown)
        clock.advance(5.0)
        watch = run.expect(j.Watch, WatchResult((), 9))
        assert (watch.prefix, watch.timeout) == (KEYS.ctl, pytest.approx(5.01))
    assert shown["timeout_in"] == pytest.approx(55.0)


def test_a_member_takes_the_master_address_from_the_watch_that_sees_rank_0_write_it() -> None:
    clock = FakeClock()
    run = Driver(j.agree_master(_ctx(clock), 0, 1))
    read = run.expect(j.GetPrefix, ({}, 5))  # rank 0 has not written it yet
    assert read.prefix == KEYS.master(0)
    master = json.dumps({"addr": "10.0.0.1", "port": 29400}).encode()
    watch = run.expect(j.Watch, WatchResult((_event(EventKind.PUT, KEYS.master(0), master, 6),), 6))
    assert (watch.prefix, watch.after) == (KEYS.master(0), 5)
    assert run.finish() == ("10.0.0.1", 29400)  # no second read


def test_rank_0_writes_the_master_address_and_reads_nothing_back() -> None:
    clock = FakeClock()
    run = Driver(j.agree_master(_ctx(clock), 0, 0))
    put = run.expect(j.Put, 3)
    assert put.key == KEYS.master(0)
    assert json.loads(put.value) == {"addr": "10.0.0.2", "port": 29500, "node": "b"}
    assert run.finish() == ("10.0.0.2", 29500)
