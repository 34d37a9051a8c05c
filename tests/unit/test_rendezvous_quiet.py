"""A running round's closer watches it for the others (``quiet``, ``closing.decide_ahead``).

Real handlers on one memory store: the closer follows ``ctl/``; every other member
watches only the closer's claim and the call under it, and is woken once.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from elastrun.rendezvous import quiet as quiet_watch
from elastrun.rendezvous.api import RendezvousInfo
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.memory import MemoryStore

K = RunKeys.of_run("job")


class _Counting:
    """One node's view of the shared store, counting its writes and reads by name."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            if args and isinstance(args[0], str):
                self.calls.append((name, args[0]))
            return method(*args, **kw)

        return call


def _nodes(
    store: MemoryStore, names: str, lo: int, hi: int, last_call: float = 30.0
) -> dict[str, Any]:
    out = {}
    for name in names:
        counting = _Counting(store)
        settings = RendezvousSettings("job", lo, hi, last_call_timeout=last_call)
        handler = DynamicRendezvousHandler(
            counting,
            settings,
            NodeDesc(name, "127.0.0.1", "default", 1),
        )
        out[name] = (handler, counting)
    return out


def _join(handlers: dict[str, DynamicRendezvousHandler], first: str | None = None,
          store: MemoryStore | None = None, n: int = 0) -> dict[str, RendezvousInfo]:  # fmt: skip
    """Every handler's next rendezvous in threads; ``first`` joins alone until it holds
    the claim of round ``n`` (it decides, and so watches the round for the others)."""
    out: dict[str, RendezvousInfo] = {}
    errors: list[BaseException] = []

    def go(name: str) -> None:
        try:
            out[name] = handlers[name].next_rendezvous()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    order = sorted(handlers, key=lambda name: name != first)
    threads = [threading.Thread(target=go, args=(name,), daemon=True) for name in order]
    for thread in threads:
        thread.start()
        if first is not None and store is not None and thread is threads[0]:
            _wait(lambda: store.get(K.closer(n)) is not None, "the first node's claim")
    for thread in threads:
        thread.join(10)
    assert not errors, errors
    assert set(out) == set(handlers)
    return out


def _wait(check: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _flags(handlers: dict[str, DynamicRendezvousHandler]) -> dict[str, threading.Event]:
    flags = {}
    for name, h in handlers.items():
        flag = threading.Event()
        h.set_change_callback(flag.set)
        flags[name] = flag
    return flags


def test_after_a_loss_the_closer_decides_ahead_and_the_others_enter_with_one_read() -> None:
    store = MemoryStore()
    both = _nodes(store, "abcde", 3, 5)
    hs = {n: h for n, (h, _) in both.items()}
    try:
        first = _join(hs, "a", store)
        result = json.loads(store.get(K.result(0)) or b"{}")
        # The closer and its deputy (rank 0, or rank 1 when the closer is rank 0).
        by_rank = sorted(hs, key=lambda n: first[n].rank)
        deputy = by_rank[1] if by_rank[0] == "a" else by_rank[0]
        assert (result["closer"], result["deputy"]) == ("a", deputy)
        lost = next(n for n in by_rank[::-1] if n not in ("a", deputy))
        survivors = {n: hs[n] for n in hs if n != lost}
        quiet = [n for n in survivors if n not in ("a", deputy)]
        flags = _flags(survivors)
        for _, counting in both.values():
            counting.calls.clear()
        hs[lost].leave()
        assert all(f.wait(5) for f in flags.values())
        # Decided before any agent joined: by the closer or its deputy, for everyone.
        _wait(lambda: store.get(K.result(1)) is not None, "round 1 decided ahead")
        for n in quiet:
            assert hs[n].change_reason == f"lost 1 node(s): {lost}"
        second = _join(survivors)
        assert {i.round for i in second.values()} == {1}
        assert {i.world_size for i in second.values()} == {4}
        kept = {n for n in survivors if first[n].rank < 4}
        assert all(second[n].rank == first[n].rank for n in kept)
        # The quiet members wrote nothing (rank 0 its address) and read nothing: the call
        # brought the result (and rank 0's address, or they watched for it).
        for n in quiet:
            calls = both[n][1].calls
            writes = [c for c in calls if c[0] in ("set", "compare_set")]
            assert writes == [] or (second[n].rank == 0 and len(writes) == 1), calls
            assert [c for c in calls if c[0] in ("get", "get_prefix")] == [], calls
            watched = {c[1] for c in calls if c[0] == "watch"}
            assert watched <= {K.closer(0), K.closer(1), K.master(1)}
            assert store.get(K.join_prefix(1) + n) is None
        call = json.loads(store.get(K.next_call(0)) or b"{}")
        assert (call["join"], call["why"]) == (False, f"lost 1 node(s): {lost}")
        assert call["result"] == json.loads(store.get(K.result(1)) or b"")
    finally:
        for h in hs.values():
            h.leave()


def test_a_failed_round_calls_the_quiet_members_to_join_themselves() -> None:
    store = MemoryStore()
    hs = {n: h for n, (h, _) in _nodes(store, "abc", 2, 3).items()}
    try:
        _join(hs, "a", store)
        flags = _flags(hs)
        assert hs["b"].outcome.report_failure(max_restarts=3, what="worker 0 exited with 1")
        # "a" sees the failure, and the round after a failure waits for every member's
        # join: "a" calls "c" to join, not to wait for a decision.
        assert flags["a"].wait(5) and flags["c"].wait(5)
        assert hs["c"].change_reason == "a worker failed on another node"
        call = json.loads(store.get(K.next_call(0)) or b"{}")
        assert call == {"join": True, "why": "a worker failed on another node"}
        second = _join(hs)
        assert {i.round for i in second.values()} == {1}
        assert {i.world_size for i in second.values()} == {3}
        for n in "abc":
            assert store.get(K.join_prefix(1) + n) is not None
    finally:
        for h in hs.values():
            h.leave()


def test_a_newcomer_with_room_is_let_in_by_the_closer_alone() -> None:
    store = MemoryStore()
    # Round 0 forms with three of at most four (at the end of a 1 s last call).
    hs = {n: h for n, (h, _) in _nodes(store, "abcd", 2, 4, last_call=1.0).items()}
    try:
        first = _join({n: hs[n] for n in "abc"}, "a", store)
        flags = _flags({n: hs[n] for n in "abc"})
        joined: dict[str, RendezvousInfo] = {}
        newcomer = threading.Thread(target=lambda: joined.update(d=hs["d"].next_rendezvous()))
        newcomer.start()
        assert all(f.wait(5) for f in flags.values())
        deputy = json.loads(store.get(K.result(0)) or b"{}")["deputy"]
        quiet = [n for n in "bc" if n != deputy]
        assert hs[quiet[0]].change_reason == "new node(s) are waiting to join"
        second = _join({n: hs[n] for n in "abc"})
        newcomer.join(10)
        assert {i.world_size for i in [*second.values(), joined["d"]]} == {4}
        assert all(second[n].rank == first[n].rank for n in "abc")
        assert joined["d"].rank == 3
        assert len(quiet) == 1 and store.get(K.join_prefix(1) + quiet[0]) is None
    finally:
        for h in hs.values():
            h.leave()


def test_the_closers_loss_wakes_the_others_and_they_re_form_by_joining() -> None:
    store = MemoryStore()
    hs = {n: h for n, (h, _) in _nodes(store, "abcd", 2, 4).items()}
    try:
        first = _join(hs, "a", store)
        deputy = json.loads(store.get(K.result(0)) or b"{}")["deputy"]
        flags = _flags({n: hs[n] for n in "bcd"})
        hs["a"].leave()  # the closer is lost: nobody watches ctl/ for the others now
        assert all(f.wait(5) for f in flags.values())
        assert hs["b"].change_reason == "lost 1 node(s): a"
        second = _join({n: hs[n] for n in "bcd"})
        assert {i.world_size for i in second.values()} == {3}
        assert {i.round for i in second.values()} == {1}
        assert sorted(i.rank for i in second.values()) == [0, 1, 2]
        if first["a"].rank == 0:  # the deputy decided, and took the lost rank 0
            assert second[deputy].rank == 0
        kept = [n for n in "bcd" if first[n].rank < 3 and second[n].rank != 0]
        assert kept and all(second[n].rank == first[n].rank for n in kept)
    finally:
        for h in hs.values():
            h.leave()


def test_a_closer_that_finished_leaves_no_one_re_forming() -> None:
    store = MemoryStore()
    hs = {n: h for n, (h, _) in _nodes(store, "abc", 2, 3).items()}
    try:
        _join(hs, "a", store)
        flags = _flags(hs)
        # "a"'s workers finished: its exit barrier, then it leaves (its claim ends).
        store.set(K.done(0) + "a", b"1")
        hs["a"].leave()
        time.sleep(0.5)
        assert not flags["b"].is_set() and not flags["c"].is_set()
    finally:
        for h in hs.values():
            h.leave()


def test_when_the_closer_and_its_deputy_are_lost_together_the_others_join_after_a_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quiet_watch, "DEPUTY_GRACE", 0.5)
    store = MemoryStore()
    hs = {n: h for n, (h, _) in _nodes(store, "abcde", 2, 5).items()}
    try:
        first = _join(hs, "a", store)
        deputy = json.loads(store.get(K.result(0)) or b"{}")["deputy"]
        quiet = {n: hs[n] for n in hs if n not in ("a", deputy)}
        flags = _flags(quiet)
        # Both lost at once: the deputy's process is dead (it decides nothing) before
        # its lease ends, so nobody watches ctl/ any more, and nobody calls.
        hs[deputy]._liveness.ahead = None
        hs["a"].leave()
        hs[deputy].leave()
        started = time.monotonic()
        assert all(f.wait(5) for f in flags.values())
        assert time.monotonic() - started >= 0.4  # they waited for a call first
        assert {hs[n].change_reason for n in quiet} == {"lost 1 node(s): a"}
        second = _join(quiet)
        assert {i.world_size for i in second.values()} == {3}
        assert sorted(i.rank for i in second.values()) == [0, 1, 2]
        kept = [n for n in quiet if first[n].rank < 3]
        assert all(second[n].rank == first[n].rank for n in kept)
    finally:
        for h in hs.values():
            h.leave()
