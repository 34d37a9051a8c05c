"""A node's liveness is one value (``condition.NodeCondition``) that each event moves to
the next one: the moves are pure, a move that cannot follow the value it meets is
refused, and a move that comes late changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import FrozenInstanceError

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import SYSTEM_CLOCK
from elastrun.core.errors import IllegalTransitionError
from elastrun.rendezvous import condition as c
from elastrun.rendezvous.closing import Called
from elastrun.rendezvous.condition import CurrentRound, NodeCondition
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import Liveness
from elastrun.store.memory import MemoryStore

FRESH = NodeCondition()
CALLED = Called(4, {}, 17)


def in_round(n: int = 3) -> NodeCondition:
    return c.entered(c.registered(FRESH, 7, 1.0), CurrentRound(n, 0, 2, "d", 9))


# -- the lease ---------------------------------------------------------------------------


def test_a_registered_lease_is_held_acknowledged_and_ends_a_loss() -> None:
    after = c.registered(c.marked_lost(FRESH, "dropped"), 5, 2.0)
    assert (after.lease, after.acked_at, after.lost) == (5, 2.0, False)
    assert after.change_reason == "dropped"  # the last reason stays for the log line


def test_a_second_lease_while_one_is_alive_is_refused() -> None:
    held = c.registered(FRESH, 5, 2.0)
    with pytest.raises(IllegalTransitionError, match="lease 6 taken while lease 5 is alive"):
        c.registered(held, 6, 3.0)
    assert c.registered(c.expired(held), 6, 3.0).lease == 6  # once it ended, a fresh one
    assert c.registered(c.revoked(held), 6, 3.0).lease == 6


def test_an_acknowledgement_of_a_lease_no_longer_held_changes_nothing() -> None:
    held = c.registered(FRESH, 5, 2.0)
    assert c.renewed(held, 5, 4.0).acked_at == 4.0
    assert c.renewed(held, 4, 4.0) is held  # the lease before it
    revoked = c.revoked(held)
    assert c.renewed(revoked, 5, 4.0) is revoked


def test_the_first_line_that_gives_the_store_up_stays() -> None:
    gone = c.store_gone(c.registered(FRESH, 5, 2.0), "first")
    assert (gone.gone, gone.lost, gone.change_reason) == ("first", True, "first")
    again = c.store_gone(c.marked_lost(gone, "no keep-alive"), "second")
    assert (again.gone, again.change_reason) == ("first", "first")
    assert c.revoked(gone).gone == "first"


# -- the round ---------------------------------------------------------------------------


def test_entering_a_round_runs_it_and_ends_a_re_formation() -> None:
    flagged = c.reform_flagged(in_round(3), 3, "lost 1 node(s): b")
    assert flagged.reform and not flagged.running
    after = c.entered(flagged, CurrentRound(4, 1, 2, "e", 12))
    assert (after.n, after.rank, after.reform, after.running) == (4, 1, False, True)
    assert after.change_reason == "lost 1 node(s): b"


@pytest.mark.parametrize(
    ("n", "rank", "size", "why"),
    [
        (4, 2, 2, "entered round 4 at rank 2 of 2"),
        (4, -1, 2, "entered round 4 at rank -1 of 2"),
        (3, 0, 2, "entered round 3 from round 3"),
        (2, 0, 2, "entered round 2 from round 3"),
    ],
)
def test_entering_a_round_not_after_the_current_one_or_at_no_rank_of_it_is_refused(
    n: int, rank: int, size: int, why: str
) -> None:
    with pytest.raises(IllegalTransitionError, match=why):
        c.entered(in_round(3), CurrentRound(n, rank, size, "d", 0))


def test_a_re_formation_is_flagged_once_for_the_round_the_node_is_in() -> None:
    running = in_round(3)
    flagged = c.reform_flagged(running, 3, "first")
    assert (flagged.reform, flagged.change_reason) == (True, "first")
    assert c.reform_flagged(flagged, 3, "second") is flagged  # once
    assert c.reform_flagged(running, 2, "late") is running  # a round it left
    assert c.reform_flagged(FRESH, 0, "none") is FRESH  # no round at all


def test_a_join_takes_the_call_that_woke_the_node_and_ends_the_re_formation() -> None:
    woken = c.woken(c.reform_flagged(in_round(3), 3, "called"), CALLED)
    assert woken.called is CALLED
    joining = c.joining(woken)
    assert (joining.called, joining.reform, joining.n) == (None, False, 3)


def test_stepping_away_notes_the_round_and_is_refused_outside_any_round() -> None:
    assert c.stepped_away(in_round(3)).away == 3
    with pytest.raises(IllegalTransitionError, match="outside any round"):
        c.stepped_away(FRESH)


def test_a_forgotten_round_lets_the_node_enter_any_round_as_a_newcomer() -> None:
    forgotten = c.forgotten(in_round(7))
    assert (forgotten.round, forgotten.n, forgotten.rank, forgotten.running) == (
        None,
        None,
        None,
        False,
    )
    assert c.entered(forgotten, CurrentRound(2, 0, 1, "d", 0)).n == 2


def test_a_condition_is_a_value_no_reader_can_change() -> None:
    now = in_round(3)
    with pytest.raises(FrozenInstanceError):
        now.reform = True  # type: ignore[misc]  # the point of the test
    assert c.reform_flagged(now, 3, "x") == c.reform_flagged(now, 3, "x")
    assert not now.reform


# -- any sequence of events --------------------------------------------------------------

Move = Callable[[NodeCondition], NodeCondition]


def _with(step: Callable[..., NodeCondition], *args: object) -> Move:
    return lambda now: step(now, *args)


MOVES = st.one_of(
    st.builds(
        _with, st.sampled_from([c.registered, c.renewed]), st.integers(1, 3), st.floats(0, 9)
    ),
    st.sampled_from([c.revoked, c.expired, c.joining, c.stepped_away, c.forgotten]),
    st.builds(_with, st.just(c.marked_lost), st.sampled_from(["a", "b"])),
    st.builds(_with, st.just(c.store_gone), st.sampled_from(["gone 1", "gone 2"])),
    st.builds(
        _with,
        st.just(c.entered),
        st.builds(
            CurrentRound,
            st.integers(0, 5),
            st.integers(-1, 3),
            st.integers(1, 3),
            st.just("d"),
            st.just(0),
        ),
    ),
    st.builds(_with, st.just(c.reform_flagged), st.integers(0, 5), st.sampled_from(["x", "y"])),
    st.builds(_with, st.just(c.woken), st.sampled_from([None, CALLED])),
)


@given(st.lists(MOVES, max_size=40))
def test_any_sequence_of_events_keeps_the_conditions_rules(moves: list[Move]) -> None:
    now, gone = FRESH, None
    for move in moves:
        try:
            after = move(now)
        except IllegalTransitionError:
            continue  # refused: the value it met stays the node's
        assert isinstance(after, NodeCondition)
        # The store, once given up, stays given up with its first line.
        assert gone is None or after.gone == gone
        gone = after.gone
        # A round is entered only after the one the node is in, at a rank of it.
        if after.round is not None and after.round is not now.round:
            assert now.round is None or after.round.n > now.round.n
            assert 0 <= after.round.rank < after.round.size
            assert after.running
        # Whether a round runs follows from the round and its re-formation alone.
        assert after.running == (after.round is not None and not after.reform)
        now = after


# -- Liveness applies the moves, and wakes the watch of a round that starts --------------


def _liveness() -> Liveness:
    return Liveness(
        MemoryStore(),
        RunKeys.of_run("condition"),
        "me",
        ttl=10.0,
        max_nodes=2,
        clock=SYSTEM_CLOCK,
        life=CancelScope(),
        decided_rows=lambda n, since: [],
    )


def test_a_snapshot_stays_as_it_was_taken_while_the_node_moves_on() -> None:
    live = _liveness()
    first = live.now
    before, after = live.move(c.registered, 5, 1.0)
    assert before is first and after is live.now
    assert first == NodeCondition() and live.now.lease == 5


def test_the_watch_sleeps_between_a_re_formation_and_the_next_round() -> None:
    live = _liveness()
    live.move(c.entered, CurrentRound(0, 0, 2, "d", 0))
    assert live.entered.is_set()
    live.move(c.reform_flagged, 0, "lost 1 node(s): b")
    assert not live.entered.is_set()
    live.move(c.joining)  # the join runs no watch: it watches what it needs itself
    live.move(c.reform_flagged, 0, "late")
    assert not live.entered.is_set()
    live.move(c.entered, CurrentRound(1, 0, 2, "e", 0))
    assert live.entered.is_set()
    live.move(c.forgotten)
    assert not live.entered.is_set()


def test_a_refused_move_leaves_the_condition_as_it_was() -> None:
    live = _liveness()
    live.move(c.registered, 5, 1.0)
    held = live.now
    with pytest.raises(IllegalTransitionError):
        live.move(c.registered, 6, 2.0)
    assert live.now is held
