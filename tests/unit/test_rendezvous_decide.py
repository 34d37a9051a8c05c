"""Rendezvous decisions are pure functions: membership, ranks, closing, re-formation."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from elastrun.rendezvous.decide import (
    Joiner,
    Verdict,
    decide_round,
    lead,
    order_members,
)


def _j(node: str, prev: int | None = None, rev: int = 0) -> Joiner:
    return Joiner(node, rev, prev)


def test_previous_members_keep_their_group_rank() -> None:
    joiners = [_j("new", None, 1), _j("b", 1), _j("c", 2), _j("a", 0)]
    assert order_members(joiners, 4) == ("a", "b", "c", "new")


def test_a_lost_node_leaves_its_rank_to_the_next_joiner() -> None:
    # "b" (rank 1) is gone; "c" keeps rank 2 only if it is still below the world size.
    assert order_members([_j("a", 0), _j("c", 2)], 4) == ("a", "c")
    assert order_members([_j("a", 0), _j("c", 2), _j("n", None)], 4) == ("a", "n", "c")


def test_previous_members_are_preferred_over_newcomers_at_max() -> None:
    assert set(order_members([_j("x"), _j("a", 0), _j("b", 1)], 2)) == {"a", "b"}


@given(
    st.lists(st.tuples(st.text("abcdef", min_size=1, max_size=4), st.none() | st.integers(0, 6)),
             unique_by=lambda t: t[0], min_size=1, max_size=8),
    st.integers(1, 8),
)  # fmt: skip
def test_members_are_a_permutation_of_chosen_joiners(
    pairs: list[tuple[str, int | None]], cap: int
) -> None:
    joiners = [Joiner(n, i, p) for i, (n, p) in enumerate(pairs)]
    members = order_members(joiners, cap)
    assert len(members) == min(cap, len(joiners))
    assert len(set(members)) == len(members)
    assert set(members) <= {j.node_id for j in joiners}
    assert order_members(list(reversed(joiners)), cap) == members


KW = dict(min_nodes=2, max_nodes=3, last_call=30.0, join_deadline=600.0)


def test_first_round_closes_at_max_at_once() -> None:
    d = decide_round([_j("a"), _j("b"), _j("c")], set(), now=0, call_started_at=None,
                     # arg-type: KW is a dict[str, float]; min_nodes and max_nodes take ints
                     first_round=True, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.CLOSE and len(d.members) == 3


def test_first_round_waits_for_the_last_call_above_min() -> None:
    d = decide_round([_j("a"), _j("b")], set(), now=10, call_started_at=5,
                     # arg-type: KW is a dict[str, float]; min_nodes and max_nodes take ints
                     first_round=True, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.WAIT and d.wake_at == 35
    d = decide_round([_j("a"), _j("b")], set(), now=35, call_started_at=5,
                     # arg-type: KW is a dict[str, float]; min_nodes and max_nodes take ints
                     first_round=True, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.CLOSE


def test_reformation_closes_when_every_live_member_is_back() -> None:
    d = decide_round([_j("a", 0), _j("b", 1)], {"a", "b"}, now=0, call_started_at=0,
                     # arg-type: KW is a dict[str, float]; min_nodes and max_nodes take ints
                     first_round=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.CLOSE and d.members == ("a", "b")


def test_spares_wait_without_deadline_until_a_member_rejoins() -> None:
    d = decide_round([_j("spare")], {"a", "b", "c"}, now=10_000, call_started_at=None,
                     # arg-type: KW is a dict[str, float]; min_nodes and max_nodes take ints
                     first_round=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.WAIT and d.wake_at is None


def test_below_min_times_out_at_the_join_deadline() -> None:
    d = decide_round([_j("a", 0)], {"a"}, now=600, call_started_at=None,
                     # arg-type: KW is a dict[str, float]; min_nodes and max_nodes take ints
                     first_round=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.TIMEOUT


# --- views kept from watch events ---------------------------------------------------------

from elastrun.rendezvous.decide import (  # noqa: E402
    RoundView,
    shape_of,
)
from elastrun.rendezvous.keys import RunKeys  # noqa: E402
from elastrun.rendezvous.members import (  # noqa: E402
    PAGE_SIZE,
    member_pages,
    page_count,
    page_entries,
    page_of,
    rows_of_pages,
)
from elastrun.rendezvous.running import RoundWatch  # noqa: E402
from elastrun.store.api import EventKind, WatchEvent  # noqa: E402

K = RunKeys("/elastrun/job/")


def _put(key: str, value: bytes = b"{}") -> WatchEvent:
    return WatchEvent(EventKind.PUT, key, value, 0)


def _del(key: str) -> WatchEvent:
    return WatchEvent(EventKind.DELETE, key, None, 0)


def test_round_view_follows_joins_and_liveness_from_events() -> None:
    view = RoundView(K, 1, previous=("a", "b"))
    joins = {K.join_prefix(1) + "x": b'{"prev_rank": null}'}
    view.load(joins, [K.nodes + "a", K.nodes + "x"], None)
    assert not view.started() and view.previous_live() == {"a"}
    view.apply([
        _put(K.join_prefix(1) + "a", b'{"prev_rank": 0}'),
        _put(K.join_prefix(2) + "z"),  # another round: ignored
        _del(K.nodes + "x"),
        _del(K.join_prefix(1) + "x"),
        _put(K.closed, b"finished"),
    ])  # fmt: skip
    assert [(j.node_id, j.prev_rank) for j in view.joiners()] == [("a", 0)]
    assert view.started() and view.live == {"a"} and view.closed == b"finished"


def test_round_watch_asks_about_membership_only_when_it_matters() -> None:
    asked: list[str] = []

    def is_member(node: str) -> bool:
        asked.append(node)
        return node in {"a", "b"}

    w = RoundWatch(K, 0, size=2, max_nodes=2, is_member=is_member)
    w.apply([_put(K.nodes + "s"), _put(K.join_prefix(1) + "s")])  # a spare at max
    assert w.reason() is None
    w.apply([_del(K.nodes + "s"), _del(K.join_prefix(1) + "s")])
    assert w.reason() is None and "s" in asked
    w.apply([_del(K.nodes + "b")])
    assert w.reason() == "lost 1 node(s): b"
    w.apply([_put(K.nodes + "b")])  # came back before anyone acted
    assert w.reason() is None
    w.apply([_put(K.join_prefix(1) + "a")])
    assert w.reason() == "node(s) of this round are joining the next one"


def test_round_watch_room_failure_and_close() -> None:
    w = RoundWatch(K, 3, size=1, max_nodes=2, is_member=lambda n: n == "a")
    w.apply([_put(K.join_prefix(4) + "new")])
    assert w.reason() == "new node(s) are waiting to join"
    w2 = RoundWatch(K, 3, size=2, max_nodes=2, is_member=lambda n: True)
    w2.apply([_put(K.failed(2)), _put(K.closed + "x")])  # other round, other key
    assert w2.reason() is None
    w2.apply([_put(K.failed(3))])
    assert w2.reason() == "a worker failed on another node"
    w2.load(["a", "b"], [K.nodes + "a"], [], failed=False, closed=True)
    assert w2.reason() == "the run was closed by another node" and w2.lost == {"b"}


def test_shape_is_run_length_in_rank_order() -> None:
    assert shape_of([]) == []
    assert shape_of([("t", 8)] * 3) == [["t", 8, 3]]
    assert shape_of([("t", 8), ("t", 4), ("t", 4), ("e", 4)]) == [
        ["t", 8, 1], ["t", 4, 2], ["e", 4, 1]
    ]  # fmt: skip


def test_member_pages_hold_each_member_once_on_its_page_and_give_back_the_rank_order() -> None:
    rows = [
        (f"node-{i:04d}", f"10.0.{i // 256}.{i % 256}", "t", 8) for i in range(5 * PAGE_SIZE + 3)
    ]
    rows.reverse()  # group-rank order need not be id order
    pages = member_pages(rows)
    assert len(pages) == page_count(len(rows)) == 6
    raws = [json.dumps(p).encode() for p in pages]
    for rank, (node, addr, role, lws) in enumerate(rows):
        assert page_entries(raws[page_of(node, len(pages))])[node] == [rank, addr, role, lws]
    assert sum(len(page_entries(r)) for r in raws) == len(rows)
    assert rows_of_pages(raws) == [list(r) for r in rows]
    assert max(len(page_entries(r)) for r in raws) < 2 * PAGE_SIZE  # the hash spreads them


def test_a_single_member_has_one_page_and_a_missing_page_has_no_entries() -> None:
    assert page_count(0) == page_count(1) == 1 and page_of("a", 1) == 0
    assert page_entries(None) == {} and page_entries(b"not json") == {}
    assert rows_of_pages([None]) == []


def test_the_decider_takes_a_lost_rank_0_and_the_node_ordered_there_takes_its_rank() -> None:
    previous = ("a", "b", "c", "d")
    # "a" (rank 0) lost: order_members puts "d" (rank 3, no longer below the size) there.
    members = order_members([Joiner(n, 0, previous.index(n)) for n in "bcd"], 4)
    assert members == ("d", "b", "c")
    assert lead(members, previous, "b") == ("b", "d", "c")  # two ranks change, not one
    # Rank 0 kept, the decider at rank 0 already, or not a member: nothing moves.
    assert lead(("a", "b", "c"), previous, "b") == ("a", "b", "c")
    assert lead(members, previous, "d") == members
    assert lead(members, previous, "x") == members
    assert lead(members, (), "b") == members
