"""The nodes' agreement on an in-process round (on a real in-memory store), and the
round's bound."""

from __future__ import annotations

import threading

import pytest

from elastrun.agent.options import (
    DEFAULT_INPROCESS_TIMEOUT,
    inprocess_timeout,
)
from elastrun.core.cancel import CancelScope
from elastrun.core.errors import ConfigError
from elastrun.inprocess.agent.agree import Agreement, Offer, agree
from elastrun.pace import AutoTimeout
from elastrun.store.memory import MemoryStore
from elastrun.wire.env import INPROCESS_TIMEOUT_ENV

PREFIX = "/elastrun/r/rounds/3/inprocess/"


def _agree_all(offers: list[Offer], timeout: float = 5.0) -> list[Agreement | None]:
    store = MemoryStore()
    got: list[Agreement | None] = [None] * len(offers)

    def node(rank: int) -> None:
        got[rank] = agree(store, PREFIX, rank, len(offers), offers[rank], timeout)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(len(offers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return got


def test_offers_survive_the_store_and_junk_is_no_offer() -> None:
    for offer in (Offer(True, 4, ("0100007F:1F90",)), Offer(False, 2, fresh=True)):
        assert Offer.from_json(offer.to_json()) == offer
    assert Offer.from_json(None) is None
    assert Offer.from_json(b"not json") is None
    assert Offer.from_json(b'{"kept": true}') is None


def test_when_every_node_kept_its_workers_they_agree_on_one_round() -> None:
    offers = [Offer(True, 2, ("A:1",)), Offer(True, 5, ("B:2", "A:1")), Offer(True, 0, ())]
    got = _agree_all(offers)
    assert got == [Agreement(6, ("A:1", "B:2"))] * 3  # one past the newest; every listener


def test_one_node_refusing_makes_every_node_restart() -> None:
    got = _agree_all([Offer(True, 1, ("A:1",)), Offer(False, 0), Offer(True, 1, ())])
    assert got == [None, None, None]


def test_a_node_starting_afresh_joins_the_round_of_the_nodes_that_kept_theirs() -> None:
    got = _agree_all([Offer(True, 3, ("A:1",)), Offer(False, 0, fresh=True)])
    assert got == [Agreement(4, ("A:1",))] * 2  # the world grows in place


def test_kept_workers_that_hold_no_state_make_every_node_restart() -> None:
    # Every kept worker is a replacement that had not synchronised yet: the newest
    # commit is gone with the workers that held it, and a round would start over.
    lost = Offer(True, 3, ("A:1",), holds=False)
    assert _agree_all([lost, Offer(True, 3, ("B:1",), holds=False)]) == [None, None]
    assert _agree_all([lost, Offer(False, 0, fresh=True)]) == [None, None]
    # One node whose workers hold the state is enough: it hands the commit on.
    got = _agree_all([lost, Offer(True, 3, ("B:1",))])
    assert got == [Agreement(4, ("A:1", "B:1"))] * 2


def test_an_offer_without_its_holds_word_holds_the_state() -> None:
    raw = b'{"kept": true, "fresh": false, "round": 2, "listeners": []}'
    assert Offer.from_json(raw) == Offer(True, 2, ())
    assert Offer.from_json(Offer(True, 2, (), holds=False).to_json()) == Offer(
        True, 2, (), holds=False
    )


def test_when_every_node_starts_afresh_the_round_is_an_ordinary_one() -> None:
    assert _agree_all([Offer(False, 0, fresh=True)] * 3) == [None, None, None]


def test_a_node_that_never_offers_counts_as_a_refusal() -> None:
    store = MemoryStore()
    assert agree(store, PREFIX, 0, 2, Offer(True, 1, ()), 0.2) is None


def test_a_node_alone_agrees_with_itself() -> None:
    assert _agree_all([Offer(True, 7, ("A:1",))]) == [Agreement(8, ("A:1",))]


def test_the_wait_ends_with_the_callers_scope() -> None:
    store = MemoryStore()
    scope = CancelScope()
    threading.Timer(0.1, scope.cancel).start()
    ended = []
    with scope.active():
        try:
            agree(store, PREFIX, 0, 2, Offer(True, 1, ()), 30)
        except Exception as exc:  # Cancelled
            ended.append(type(exc).__name__)
    assert ended == ["Cancelled"]


def test_the_rounds_bound_is_the_variable_or_a_shorter_fixed_hang_timeout() -> None:
    assert inprocess_timeout({}) == DEFAULT_INPROCESS_TIMEOUT
    assert inprocess_timeout({INPROCESS_TIMEOUT_ENV: "5"}) == 5.0
    assert inprocess_timeout({}, 7.0) == 7.0  # --hang-timeout 7: a survivor stuck 7 s is hung
    assert inprocess_timeout({INPROCESS_TIMEOUT_ENV: "5"}, 7.0) == 5.0
    assert (
        inprocess_timeout({}, AutoTimeout()) == DEFAULT_INPROCESS_TIMEOUT
    )  # no fixed bound to take
    with pytest.raises(ConfigError, match=INPROCESS_TIMEOUT_ENV):
        inprocess_timeout({INPROCESS_TIMEOUT_ENV: "-1"})
