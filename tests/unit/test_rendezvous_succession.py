"""A re-formation decided at once: the live members of the previous round are presumed
joined with their ranks (``decide.presume``), the result lists the few rank changes
(``members.changes_from`` / ``place_in``), and a running round whose result says
``all_live`` knows a lost node was a member without a read. Pure functions fed inputs,
and the joining protocol fed results one operation at a time."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from elastrun.rendezvous import joining as j
from elastrun.rendezvous.decide import (
    Joiner,
    RoundView,
    Verdict,
    decide_round,
    order_members,
    presume,
)
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.members import CHANGES_MAX, Place, changes_from, place_in
from elastrun.rendezvous.running import RoundWatch
from elastrun.rendezvous.settings import RendezvousSettings
from elastrun.store.api import EventKind, WatchEvent, WatchResult
from elastrun.testing import FakeClock

K = RunKeys("/elastrun/job/")
KW: dict[str, Any] = dict(
    max_nodes=8, now=0.0, call_started_at=None, last_call=30.0, join_deadline=600.0
)


def _j(node: str, prev: int | None = None) -> Joiner:
    return Joiner(node, 0, prev)


# -- decisions --------------------------------------------------------------------------


def test_a_reformation_closes_as_soon_as_one_live_member_joins_with_everyone_in_their_ranks() -> (
    None
):
    previous = ("a", "b", "c", "d")  # "b" (rank 1) was lost
    d = decide_round(
        [_j("c", 2)], {"a", "c", "d"}, min_nodes=2, first_round=False, previous=previous, **KW
    )
    assert d.verdict is Verdict.CLOSE
    # What the full re-join of a, c and d would give: "d" moves into the free rank 1.
    full = order_members([_j("a", 0), _j("c", 2), _j("d", 3)], 8)
    assert d.members == full == ("a", "d", "c")


def test_without_the_previous_order_a_reformation_still_waits_for_every_live_member() -> None:
    d = decide_round([_j("c", 2)], {"a", "c", "d"}, min_nodes=2, first_round=False, **KW)
    assert d.verdict is Verdict.WAIT


def test_spares_alone_do_not_start_a_reformation_even_with_the_previous_order() -> None:
    d = decide_round(
        [_j("spare")], {"a", "b"}, min_nodes=1, first_round=False, previous=("a", "b"), **KW
    )
    assert d.verdict is Verdict.WAIT and d.wake_at is None


def test_a_newcomer_that_joined_takes_a_free_rank_as_in_a_full_rejoin() -> None:
    previous = ("a", "b", "c")  # "b" lost; "n" waits to join
    joiners = [_j("n"), _j("a", 0)]
    d = decide_round(joiners, {"a", "c"}, min_nodes=2, first_round=False, previous=previous, **KW)
    assert d.verdict is Verdict.CLOSE
    assert d.members == order_members([_j("n"), _j("a", 0), _j("c", 2)], 8) == ("a", "n", "c")


def test_presumed_members_below_the_minimum_wait_for_joiners_then_time_out() -> None:
    previous = ("a", "b", "c")
    args: dict[str, Any] = dict(min_nodes=3, first_round=False, previous=previous)
    kw = {**KW, "join_deadline": 60.0}
    d = decide_round([_j("a", 0)], {"a", "c"}, **args, **kw)
    assert d.verdict is Verdict.WAIT and d.wake_at == 60.0
    assert decide_round([_j("a", 0)], {"a", "c"}, **args, **{**kw, "now": 60.0}).verdict is (
        Verdict.TIMEOUT
    )
    # A newcomer brings the round to its minimum: it closes at once.
    d = decide_round([_j("a", 0), _j("n")], {"a", "c"}, **args, **kw)
    assert d.verdict is Verdict.CLOSE and d.members == ("a", "n", "c")


def test_an_excluded_member_is_not_presumed() -> None:
    previous = ("a", "b", "c")
    d = decide_round(
        [_j("a", 0)], {"a", "b", "c"}, min_nodes=1, first_round=False, previous=previous,
        excluded={"b"}, **KW,
    )  # fmt: skip
    assert d.verdict is Verdict.CLOSE and d.members == ("a", "c")


@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)), st.integers(0, n - 1))
    ),
    st.integers(0, 2),
)
def test_presumed_ranks_are_those_of_a_full_rejoin(
    case: tuple[int, set[int], int], new: int
) -> None:
    size, lost, first = case
    previous = tuple(f"n{i:02d}" for i in range(size))
    live = [p for i, p in enumerate(previous) if i not in lost]
    if not live:
        return
    starter = live[first % len(live)]
    newcomers = [_j(f"z{i}") for i in range(new)]
    joined = [_j(starter, previous.index(starter)), *newcomers]
    pending = set(live) - {starter}
    full = [*joined, *(_j(p, previous.index(p)) for p in pending)]
    assert order_members(presume(joined, pending, previous), 16) == order_members(full, 16)


# -- the result's changes ---------------------------------------------------------------


def test_a_result_lists_who_moved_and_who_was_dropped_and_each_node_finds_its_place() -> None:
    previous = ("a", "b", "c", "d")
    members = ("a", "d", "c", "n")  # b lost, d into rank 1, a newcomer n at rank 3
    changes = changes_from(previous, members)
    assert changes == {"moved": {"d": 1, "n": 3}, "dropped": ["b"]}
    result = {"id": "x", "size": 4, "from": {"round": 6, **changes}}
    assert place_in(result, "a", 6, 0) == Place(True, 0)
    assert place_in(result, "c", 6, 2) == Place(True, 2)
    assert place_in(result, "d", 6, 3) == Place(True, 1)
    assert place_in(result, "n", None, None) == Place(False)  # a newcomer reads its page
    assert place_in(result, "b", 6, 1) == Place(True, None)  # dropped: not a member
    assert place_in(result, "a", 5, 0) == Place(False)  # another round: read the page
    assert place_in({"id": "x", "size": 4}, "a", 6, 0) == Place(False)


def test_too_many_changes_are_not_listed() -> None:
    previous = tuple(f"p{i}" for i in range(CHANGES_MAX + 2))
    assert changes_from(previous, previous[CHANGES_MAX + 1 :]) is None
    assert changes_from((), ("a",)) is None


def test_the_closer_publishes_the_changes_and_whether_every_live_node_is_a_member() -> None:
    view = RoundView(K, 3, previous=("a", "b", "c"))
    joins = {K.join_prefix(3) + "a": b'{"prev_rank": 0, "addr": "h", "role": "t"}'}
    view.load(joins, [K.nodes + "a", K.nodes + "c"], None)
    verdict = view.decide(_bounds(2, 3), now=0.0, call_started_at=None, join_deadline=60.0)
    assert verdict.verdict is Verdict.CLOSE and verdict.members == ("a", "c")
    _, result = view.outcome(verdict.members, "d1", 42)
    assert result["from"] == {"round": 2, "moved": {"c": 1}, "dropped": ["b"]}
    assert result["all_live"] is True and result["rev"] == 42
    view.apply([WatchEvent(EventKind.PUT, K.nodes + "spare", b"{}", 43)])
    assert "all_live" not in view.outcome(verdict.members, "d2", 43)[1]


def _bounds(lo: int, hi: int) -> RendezvousSettings:
    return RendezvousSettings("job", lo, hi, last_call_timeout=30.0)


# -- the running round under all_live -------------------------------------------------------


def test_under_all_live_a_lost_node_is_a_member_without_asking_unless_it_registered_since() -> None:
    asked: list[str] = []

    def is_member(node: str) -> bool:
        asked.append(node)
        return False

    w = RoundWatch(K, 0, size=3, max_nodes=3, is_member=is_member, all_live=True)
    w.apply([WatchEvent(EventKind.DELETE, K.nodes + "b", None, 5)])
    assert w.reason() == "lost 1 node(s): b" and asked == []
    w = RoundWatch(K, 0, size=3, max_nodes=4, is_member=is_member, all_live=True)
    w.apply([WatchEvent(EventKind.PUT, K.nodes + "s", b"{}", 5)])  # a spare registers
    w.apply([WatchEvent(EventKind.DELETE, K.nodes + "s", None, 6)])  # and leaves
    assert w.reason() is None and asked == ["s"]
    w.load(["a"], [K.nodes + "a"], [], failed=False, closed=False)  # re-read: no shortcut
    w.apply([WatchEvent(EventKind.DELETE, K.nodes + "t", None, 9)])
    assert asked == ["s", "t"] and w.reason() is None


# -- the protocol, fed results ---------------------------------------------------------------


def _ctx(clock: FakeClock, node: str, lo: int = 2, hi: int = 4) -> j.Context:
    return j.Context(
        keys=K, node_id=node, info={"addr": "10.0.0.9", "role": "t", "local_world_size": 1},
        bounds=_bounds(lo, hi), join_timeout=60.0, run_id="job", clock=clock,
        new_port=lambda: 29500,
    )  # fmt: skip


class Driver:
    def __init__(self, protocol: j.Protocol) -> None:
        self.protocol = protocol
        self.op: j.Op | j.Finished = j.advance(protocol, None, None)

    def expect(self, kind: type[Any], answer: Any = None) -> Any:
        op = self.op
        assert isinstance(op, kind), op
        self.op = j.advance(self.protocol, answer, None)
        return op

    def finish(self) -> Any:
        assert isinstance(self.op, j.Finished), self.op
        return self.op.value


def _succession(size: int = 3) -> bytes:
    since = {"round": 6, "moved": {"d": 1}, "dropped": ["b"]}
    return json.dumps({"id": "r7", "size": size, "rev": 50, "shape": [], "from": since}).encode()


MASTER = json.dumps({"addr": "10.0.0.1", "port": 29400}).encode()


def test_a_survivor_of_a_decided_reformation_enters_with_one_read_and_writes_nothing() -> None:
    run = Driver(j.join(_ctx(FakeClock(), "c"), 6, 2))
    read = run.expect(j.GetPrefix, ({K.result(7): _succession(), K.master(7): MASTER}, 60))
    assert read.prefix == K.out(7)  # the round after its own: no read of ``current``
    joined = run.finish()
    assert (joined.n, joined.rank, joined.master) == (7, 2, ("10.0.0.1", 29400))


def test_a_survivor_that_moved_takes_its_new_rank_and_watches_out_for_the_master() -> None:
    run = Driver(j.join(_ctx(FakeClock(), "d"), 6, 3))
    run.expect(j.GetPrefix, ({K.result(7): _succession()}, 60))  # rank 0 not there yet
    watch = run.expect(
        j.Watch, WatchResult((WatchEvent(EventKind.PUT, K.master(7), MASTER, 61),), 61)
    )
    assert (watch.prefix, watch.after) == (K.master(7), 60)
    joined = run.finish()
    assert (joined.rank, joined.master) == (1, ("10.0.0.1", 29400))


def test_a_member_dropped_from_the_decided_round_moves_on_as_a_spare() -> None:
    run = Driver(j.join(_ctx(FakeClock(), "b"), 6, 1))
    run.expect(j.GetPrefix, ({K.result(7): _succession()}, 60))
    assert run.expect(j.Get, b"7").key == K.current  # not in 7: after the newest round
    read = run.expect(j.GetPrefix, ({}, 61))
    assert read.prefix == K.out(8)
    put = run.expect(j.Put, 62)
    assert put.key == K.join_prefix(8) + "b" and json.loads(put.value)["prev_rank"] == 1


def test_the_first_survivor_to_join_decides_at_once_for_all_and_publishes_the_changes() -> None:
    clock = FakeClock()
    run = Driver(j.join(_ctx(clock, "c"), 6, 2))
    run.expect(j.GetPrefix, ({}, 60))  # nothing decided, no closer yet
    run.expect(j.Put, 61)  # its join
    run.expect(j.CompareSet, (True, None))  # it claims the closer
    # Its view: round 6's members from their pages, its own join, the live nodes.
    own = json.dumps({"prev_rank": 2, "addr": "h", "role": "t", "local_world_size": 1})
    live = {K.nodes + n: b"{}" for n in ("a", "c", "d")}  # "b" was lost
    reads = run.expect(
        j.ReadAll,
        [
            ({K.join_prefix(7) + "c": own.encode()}, 61),
            (live, 62),
            ({}, 61),
            None,
            _round6(),
            *_nothing_more(61),
        ],
    ).reads
    assert reads[4] == j.Get(K.result(6))
    pages = {K.members(6, "r6", 0): json.dumps({"members": _rows6()}).encode()}
    run.expect(j.GetPrefix, (pages, 62))
    # The reads answered at revisions 61 and 62: what changed in between is applied.
    catch_up = run.expect(j.Watch, WatchResult((), 62))
    assert (catch_up.prefix, catch_up.after, catch_up.timeout) == (K.ctl, 61, 0.0)
    assert run.expect(j.Seen) == j.Seen(7, 1)
    put_all = run.expect(j.PutAll)  # no wait for "a" and "d": they are presumed
    entries = json.loads(put_all.items[0][1])["members"]
    assert {n: e[0] for n, e in entries.items()} == {"a": 0, "d": 1, "c": 2}
    # A presumed member brings what it brought to round 6 (it has written nothing yet).
    assert entries["a"] == [0, "h", "t", 1]
    publish = run.expect(j.CompareSet, (True, None))
    result = json.loads(publish.value)
    assert result["shape"] == [["t", 1, 3]]
    assert result["from"] == {"round": 6, "moved": {"d": 1}, "dropped": ["b"]}
    assert result["all_live"] is True and result["rev"] == 62
    assert result["closer"] == "c"  # a member: it watches round 7 for the others
    call = run.expect(j.Put, 63)  # the call that wakes round 6's quiet members
    assert call.key == K.next_call(6)
    assert json.loads(call.value) == {"join": False, "why": "lost 1 node(s): b", "result": result}
    run.expect(j.Put, 64)  # current
    run.expect(j.Closed)
    # Not rank 0: it watches out/ for the master address.
    watch = run.expect(j.GetPrefix, ({K.master(7): MASTER}, 64))
    assert watch.prefix == K.master(7)
    assert run.finish().rank == 2


def _nothing_more(rev: int) -> list[object]:
    """The closer's reads of round 6's failure claim, exit barrier and notices: empty."""
    return [({}, rev)] * 3


def _round6() -> bytes:
    return json.dumps({"id": "r6", "size": 4, "rev": 10, "shape": []}).encode()


def _rows6() -> dict[str, list[object]]:
    return {n: [i, "h", "t", 1] for i, n in enumerate(("a", "b", "c", "d"))}


def test_a_waiting_survivor_takes_over_when_the_deciding_node_dies_mid_publication() -> None:
    clock = FakeClock()
    run = Driver(j.join(_ctx(clock, "d"), 6, 3))
    run.expect(j.GetPrefix, ({K.closer(7): b"c"}, 60))  # "c" decides
    run.expect(j.Put, 61)
    # "c" wrote some pages, then died: its claim vanishes with its lease, no result.
    gone = WatchEvent(EventKind.DELETE, K.closer(7), None, 70)
    run.expect(j.Watch, WatchResult((gone,), 70))
    run.expect(j.CompareSet, (True, None))  # "d" takes over
    joins = {K.join_prefix(7) + n: json.dumps({"prev_rank": r}).encode() for n, r in (("d", 3),)}
    live = {K.nodes + n: b"{}" for n in ("a", "d")}  # b, c gone
    run.expect(j.ReadAll, [(joins, 71), (live, 71), ({}, 71), None, _round6(), *_nothing_more(71)])
    run.expect(
        j.GetPrefix, ({K.members(6, "r6", 0): json.dumps({"members": _rows6()}).encode()}, 71)
    )
    run.expect(j.Seen)
    entries = json.loads(run.expect(j.PutAll).items[0][1])["members"]
    assert {n: e[0] for n, e in entries.items()} == {"a": 0, "d": 1}
    result = json.loads(run.expect(j.CompareSet, (True, None)).value)
    assert result["from"]["dropped"] == ["b", "c"] and result["size"] == 2


def test_a_survivor_that_loses_the_race_for_the_claim_watches_on_without_reading_again() -> None:
    run = Driver(j.join(_ctx(FakeClock(), "d"), 6, 3))
    run.expect(j.GetPrefix, ({}, 60))  # no claim seen
    run.expect(j.Put, 61)
    run.expect(j.CompareSet, (False, b"c"))  # "c" was first
    result = WatchEvent(EventKind.PUT, K.result(7), _succession(), 64)
    watch = run.expect(j.Watch, WatchResult((result,), 64))
    assert (watch.prefix, watch.after) == (K.out(7), 60)
    run.expect(j.Watch, WatchResult((WatchEvent(EventKind.PUT, K.master(7), MASTER, 65),), 65))
    assert run.finish().rank == 1


def test_a_node_that_dies_between_the_closers_reads_is_neither_presumed_nor_counted_live() -> None:
    # The reads answer at revisions 61 and 62; "d" died at 62, after the join read. The
    # view takes the change in before deciding, so "d" is not presumed, and ``all_live``
    # holds for the live nodes at the result's revision.
    run = Driver(j.join(_ctx(FakeClock(), "c"), 6, 2))
    run.expect(j.GetPrefix, ({}, 60))
    run.expect(j.Put, 61)
    run.expect(j.CompareSet, (True, None))
    own = json.dumps({"prev_rank": 2, "addr": "h", "role": "t", "local_world_size": 1})
    live_at_61 = {K.nodes + n: b"{}" for n in ("a", "c", "d")}
    run.expect(
        j.ReadAll,
        [
            ({K.join_prefix(7) + "c": own.encode()}, 61),
            (live_at_61, 61),
            ({}, 60),
            None,
            _round6(),
            *_nothing_more(61),
        ],
    )
    run.expect(
        j.GetPrefix, ({K.members(6, "r6", 0): json.dumps({"members": _rows6()}).encode()}, 61)
    )
    died = WatchEvent(EventKind.DELETE, K.nodes + "d", None, 61)
    run.expect(j.Watch, WatchResult((died,), 61))  # from 60, the oldest read
    run.expect(j.Seen)
    entries = json.loads(run.expect(j.PutAll).items[0][1])["members"]
    assert {n: e[0] for n, e in entries.items()} == {"a": 0, "c": 1}
    result = json.loads(run.expect(j.CompareSet, (True, None)).value)
    assert result["rev"] == 61 and result["all_live"] is True
    assert result["from"]["dropped"] == ["b", "d"]


# -- a quiet member woken by the call (``closing.decide_ahead``) -------------------------


def test_a_called_member_enters_reading_nothing_when_the_call_brings_the_address() -> None:
    result = json.loads(_succession())
    call = {"join": False, "why": "lost 1 node(s): b", "result": result}
    called = j.Called.of(K, 7, json.dumps({**call, "master": json.loads(MASTER)}).encode())
    run = Driver(j.join(_ctx(FakeClock(), "c"), 6, 2, None, called))
    joined = run.finish()  # no operation at all
    assert (joined.n, joined.rank, joined.master) == (7, 2, ("10.0.0.1", 29400))


def test_a_called_member_watches_for_the_address_from_the_decision_not_from_the_call() -> None:
    # Rank 0 may write its address after the decision and before the call: a watch from
    # the call's revision would never see it.
    result = {**json.loads(_succession()), "rev": 40}
    call = json.dumps({"join": False, "why": "lost 1 node(s): b", "result": result})
    called = j.Called.of(K, 7, call.encode())
    assert called is not None and called.rev == 40
    run = Driver(j.join(_ctx(FakeClock(), "c"), 6, 2, None, called))
    put = WatchEvent(EventKind.PUT, K.master(7), MASTER, 45)
    watch = run.expect(j.Watch, WatchResult((put,), 45))
    assert (watch.prefix, watch.after) == (K.master(7), 40)
    assert run.finish().master == ("10.0.0.1", 29400)


def test_a_call_without_a_result_brings_nothing_and_the_member_reads() -> None:
    assert j.Called.of(K, 7, json.dumps({"join": True, "why": "failed"}).encode()) is None
