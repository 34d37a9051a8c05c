"""Rendezvous decisions are pure functions: membership, ranks, closing, re-formation."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elastrun.rendezvous.decide import (
    Joiner,
    Verdict,
    decide_round,
    needs_reformation,
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
                     first_round=True, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.CLOSE and len(d.members) == 3


def test_first_round_waits_for_the_last_call_above_min() -> None:
    d = decide_round([_j("a"), _j("b")], set(), now=10, call_started_at=5,
                     first_round=True, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.WAIT and d.wake_at == 35
    d = decide_round([_j("a"), _j("b")], set(), now=35, call_started_at=5,
                     first_round=True, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.CLOSE


def test_reformation_closes_when_every_live_member_is_back() -> None:
    d = decide_round([_j("a", 0), _j("b", 1)], {"a", "b"}, now=0, call_started_at=0,
                     first_round=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.CLOSE and d.members == ("a", "b")


def test_spares_wait_without_deadline_until_a_member_rejoins() -> None:
    d = decide_round([_j("spare")], {"a", "b", "c"}, now=10_000, call_started_at=None,
                     first_round=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.WAIT and d.wake_at is None


def test_below_min_times_out_at_the_join_deadline() -> None:
    d = decide_round([_j("a", 0)], {"a"}, now=600, call_started_at=None,
                     first_round=False, **KW)  # type: ignore[arg-type]  # fmt: skip
    assert d.verdict is Verdict.TIMEOUT


def test_reformation_triggers() -> None:
    members = ("a", "b")
    assert not needs_reformation(members, {"a", "b"}, {}, max_nodes=2, round_failed=False)
    assert needs_reformation(members, {"a"}, {}, max_nodes=2, round_failed=False)
    assert needs_reformation(members, {"a", "b"}, {}, max_nodes=2, round_failed=True)
    assert needs_reformation(members, {"a", "b"}, {"a": 0}, max_nodes=2, round_failed=False)
    # A newcomer is a spare at max, but triggers a scale-up below it.
    assert not needs_reformation(
        members, {"a", "b", "n"}, {"n": 0}, max_nodes=2, round_failed=False
    )
    assert needs_reformation(members, {"a", "b", "n"}, {"n": 0}, max_nodes=3, round_failed=False)
