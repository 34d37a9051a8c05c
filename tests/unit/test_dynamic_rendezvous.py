"""The dynamic rendezvous with several simulated nodes (threads) sharing one store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import RendezvousClosedError, RendezvousTimeoutError, StoreError
from elastrun.rendezvous.api import RendezvousInfo
from elastrun.rendezvous.decide import Joiner, order_members
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.memory import MemoryStore

NAMES: dict[int, str] = {}  # id(handler) -> its node's name


def _node(store: MemoryStore, name: str, lo: int, hi: int, **kw: float) -> DynamicRendezvousHandler:
    settings = RendezvousSettings("job", lo, hi, **{"last_call_timeout": 0.3, **kw})
    handler = DynamicRendezvousHandler(store, settings, NodeDesc(name, "127.0.0.1", "default", 2))
    NAMES[id(handler)] = name
    return handler


def _all(
    handlers: list[DynamicRendezvousHandler],
    timeout: float = 10,
    closer: tuple[DynamicRendezvousHandler, MemoryStore] | None = None,
) -> dict[str, RendezvousInfo]:
    """Every handler's next rendezvous, in threads; with ``closer``, that handler joins
    first and the others once it holds the round's claim (it decides the round)."""
    out: dict[str, RendezvousInfo] = {}
    errors: list[BaseException] = []

    def go(h: DynamicRendezvousHandler) -> None:
        try:
            out[NAMES[id(h)]] = h.next_rendezvous()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    if closer is not None:
        handlers = sorted(handlers, key=lambda h: h is not closer[0])
    threads = [threading.Thread(target=go, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
        if closer is not None and t is threads[0]:
            deadline = time.monotonic() + 10
            while closer[1].get(RunKeys.of_run("job").closer(0)) is None:
                assert time.monotonic() < deadline, "no claim"
                time.sleep(0.01)
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert len(out) == len(handlers)
    return out


def _flag() -> tuple[threading.Event, Callable[[], None]]:
    ev = threading.Event()
    return ev, ev.set


def test_three_nodes_form_one_world_with_consistent_ranks() -> None:
    store = MemoryStore()
    hs = [_node(store, n, 2, 3) for n in "abc"]
    try:
        infos = _all(hs)
        assert sorted(i.rank for i in infos.values()) == [0, 1, 2]
        assert {i.world_size for i in infos.values()} == {3}
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                    for i in infos.values()}) == 1  # fmt: skip
        assert all(m.local_world_size == 2 for m in infos["a"].members)
    finally:
        for h in hs:
            h.leave()


def test_leave_ends_the_keep_alive_and_the_watch_at_once() -> None:
    before = set(threading.enumerate())
    h = _node(MemoryStore(), "solo", 1, 1)
    _all([h])
    mine = [t for t in threading.enumerate() if t not in before and t.name.startswith("elastrun")]
    assert sorted(t.name for t in mine) == ["elastrun-rdzv-keepalive", "elastrun-rdzv-watch"]
    t0 = time.monotonic()
    h.leave()
    assert time.monotonic() - t0 < 1.0  # neither the keep-alive's sleep nor the watch's span
    assert not [t.name for t in mine if t.is_alive()]


@pytest.mark.parametrize("lost_rank", [2, 0])
def test_a_lost_node_makes_survivors_reform_without_it(lost_rank: int) -> None:
    store = MemoryStore()
    hs = [_node(store, n, 2, 3) for n in "abc"]
    lost: DynamicRendezvousHandler | None = None
    try:
        first = _all(hs)
        by_rank = {first[NAMES[id(h)]].rank: h for h in hs}
        lost = by_rank[lost_rank]
        survivors = [h for h in hs if h is not lost]
        flags = {}
        for h in survivors:
            flags[NAMES[id(h)]], cb = _flag()
            h.set_change_callback(cb)
        lost.leave()  # the node dies: its lease is revoked, its keys vanish
        assert all(f.wait(5) for f in flags.values())
        assert all(h.num_nodes_waiting() == 1 for h in survivors)
        second = _all(survivors)
        assert {i.world_size for i in second.values()} == {2}
        assert {i.round for i in second.values()} == {1}
        assert sorted(i.rank for i in second.values()) == [0, 1]
        if lost_rank == 2:
            # Survivors keep their group ranks when they still fit.
            for node, info in second.items():
                assert info.rank == first[node].rank
        # (With rank 0 lost, the node that decides the round takes rank 0: ``lead``.
        # Which survivor decides is a race, so either order is right.)
        a, b = (second[NAMES[id(h)]] for h in survivors)
        # Each round publishes its own bootstrap address (a fresh port, a fresh store).
        assert first[NAMES[id(survivors[0])]].bootstrap_store_info.master_port != (
            a.bootstrap_store_info.master_port
        )
        assert a.bootstrap_store_info == b.bootstrap_store_info
    finally:
        for h in hs:
            if h is not lost:
                h.leave()


def test_a_new_node_below_max_triggers_a_scale_up() -> None:
    store = MemoryStore()
    a = _node(store, "a", 1, 2)
    b = _node(store, "b", 1, 2)
    try:
        (info,) = _all([a]).values()
        assert info.world_size == 1
        flag, cb = _flag()
        a.set_change_callback(cb)
        result: dict[str, RendezvousInfo] = {}
        t = threading.Thread(target=lambda: result.setdefault("b", b.next_rendezvous()))
        t.start()
        assert flag.wait(5), "the running node was not told of the newcomer"
        result["a"] = a.next_rendezvous()
        t.join(10)
        assert result["a"].world_size == result["b"].world_size == 2
        assert result["a"].rank == 0  # the incumbent keeps rank 0
    finally:
        a.leave()
        b.leave()


def test_a_spare_at_max_waits_and_replaces_a_lost_node() -> None:
    store = MemoryStore()
    a, b, spare = (_node(store, n, 1, 2) for n in ("a", "b", "s"))
    try:
        _all([a, b])
        flag, cb = _flag()
        a.set_change_callback(cb)
        got: dict[str, RendezvousInfo] = {}
        t = threading.Thread(target=lambda: got.setdefault("s", spare.next_rendezvous()))
        t.start()
        assert not flag.wait(0.8), "a spare at max must not disturb the running job"
        b.leave()
        assert flag.wait(5)
        got["a"] = a.next_rendezvous()
        t.join(10)
        assert got["a"].world_size == got["s"].world_size == 2
    finally:
        for h in (a, b, spare):
            h.leave()


def test_join_timeout_below_min_is_clear() -> None:
    store = MemoryStore()
    a = _node(store, "a", 2, 2, join_timeout=0.5)
    try:
        with pytest.raises(RendezvousTimeoutError, match="at least 2 needed"):
            a.next_rendezvous()
    finally:
        a.leave()


def test_the_restart_budget_is_shared_and_counted_once_per_round() -> None:
    store = MemoryStore()
    hs = [_node(store, n, 2, 2) for n in "ab"]
    try:
        _all(hs)
        assert hs[0].outcome.report_failure(1) is True
        assert hs[1].outcome.report_failure(1) is True  # same round: not counted again
        assert hs[0].outcome.restarts_used() == 1
        _all(hs)
        assert hs[1].outcome.report_failure(1) is False  # round 1: the budget of 1 is spent
        assert hs[0].is_closed()
    finally:
        for h in hs:
            h.leave()


def test_a_finished_job_refuses_late_nodes() -> None:
    store = MemoryStore()
    a = _node(store, "a", 1, 1)
    _all([a])
    a.shutdown()
    late = _node(store, "z", 1, 1)
    with pytest.raises(RendezvousClosedError, match="accepts no more nodes"):
        late.next_rendezvous()
    late.leave()


def test_every_node_learns_its_rank_and_the_shape_without_the_member_list() -> None:
    store = MemoryStore()
    hs = [_node(store, n, 3, 3) for n in "abc"]
    try:
        infos = _all(hs)
        assert {i.shape for i in infos.values()} == {(("default", 2, 3),)}
        # The full list is there for whoever asks, and agrees with the ranks.
        order = [m.node_id for m in infos["b"].members]
        assert [order.index(n) for n in "abc"] == [infos[n].rank for n in "abc"]
    finally:
        for h in hs:
            h.leave()


def test_a_waiting_node_takes_over_when_the_closer_is_gone() -> None:
    store = MemoryStore()
    # 2:3 with a 1 s last call: "a" cannot close before it leaves.
    closer = _node(store, "a", 2, 3, last_call_timeout=1.0)
    keys = RunKeys.of_run("job")
    left: list[BaseException] = []

    def join_then_leave() -> None:
        try:
            closer.next_rendezvous()
        except RendezvousClosedError as exc:
            left.append(exc)

    # "a" joins round 0 and claims the closer's role, then leaves (its lease is revoked)
    # before anyone else arrives.
    waiter = threading.Thread(target=join_then_leave, daemon=True)
    waiter.start()
    for _ in range(500):
        if store.get(keys.closer(0)) == b"a":
            break
        threading.Event().wait(0.01)
    assert store.get(keys.closer(0)) == b"a"
    b, c = (_node(store, n, 2, 3, last_call_timeout=1.0) for n in "bc")
    result: list[RendezvousInfo] = []
    tb = threading.Thread(target=lambda: result.append(b.next_rendezvous()), daemon=True)
    tb.start()
    threading.Event().wait(0.2)
    closer.leave()  # its lease ends: its claim and its join vanish
    waiter.join(10)
    assert left and "left" in str(left[0])
    try:
        infos = _all([c])
        tb.join(10)
        assert result and {result[0].rank, infos["c"].rank} == {0, 1}
        assert result[0].world_size == 2
        assert store.get(keys.closer(0)) in (b"b", b"c")
    finally:
        b.leave()
        c.leave()


# (How often the closer and the others show the round's progress: tests/unit/test_joining.py.)


# -- cancellation ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "tcp"])
def test_the_callers_cancelled_scope_ends_the_wait_for_other_nodes_at_once(kind: str) -> None:
    from elastrun.store.tcp import TcpStore, TcpStoreServer

    server = None
    store: Any = MemoryStore()
    if kind == "tcp":
        server = TcpStoreServer("127.0.0.1", 0)
        server.start()
        store = TcpStore("127.0.0.1", server.port)
    h = _node(store, "a", 2, 2)
    try:
        scope = CancelScope()
        timer = threading.Timer(0.3, scope.cancel, args=("received SIGTERM",))
        timer.start()
        t0 = time.monotonic()
        with scope.active(), pytest.raises(Cancelled, match="SIGTERM"):
            h.next_rendezvous()  # waits for a second node (join timeout: 600 s)
        assert time.monotonic() - t0 < 1.3
        timer.join()
    finally:
        t0 = time.monotonic()
        h.leave()
        assert time.monotonic() - t0 < 1.0  # its threads' waits end at once too
        store.close()
        if server is not None:
            server.stop()


def test_leave_from_another_thread_ends_a_join_as_left() -> None:
    store = MemoryStore()
    h = _node(store, "a", 2, 2)
    threading.Timer(0.3, h.leave).start()
    t0 = time.monotonic()
    with pytest.raises(RendezvousClosedError, match="left"):
        h.next_rendezvous()
    assert time.monotonic() - t0 < 1.3


# -- a re-formation decided at once (``decide.presume``) ----------------------------------------


class _DiesWhilePublishing:
    """A node's store that kills the node (revokes its lease and fails) at its first
    member page of ``round_``, once ``waiting`` have joined that round."""

    def __init__(self, inner: MemoryStore, round_: int, waiting: list[str]) -> None:
        self._inner = inner
        self._pages = f"/rounds/{round_}/members/"
        self._joins = RunKeys.of_run("job").join_prefix(round_)
        self._waiting = waiting
        self.lease: int | None = None
        self.died = threading.Event()

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        if self._pages in key and not self.died.is_set():
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                found, _ = self._inner.get_prefix(self._joins)
                if all(self._joins + n in found for n in self._waiting):
                    break
                time.sleep(0.01)
            assert self.lease is not None
            self._inner.revoke_lease(self.lease)
            self.died.set()
            raise StoreError("this node died while publishing")
        return self._inner.set(key, value, lease=lease)

    def grant_lease(self, ttl: float) -> int:
        self.lease = self._inner.grant_lease(ttl)
        return self.lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_survivors_reform_at_once_keeping_ranks_and_take_over_from_a_closer_that_dies() -> None:
    store = MemoryStore()
    dying = _DiesWhilePublishing(store, 1, [])
    settings = RendezvousSettings("job", 2, 4, last_call_timeout=30.0)
    a = DynamicRendezvousHandler(dying, settings, NodeDesc("a", "127.0.0.1", "default", 2))
    NAMES[id(a)] = "a"
    b, c, d = (_node(store, n, 2, 4, last_call_timeout=30.0) for n in "bcd")
    keys = RunKeys.of_run("job")
    try:
        first = _all([a, b, c, d], closer=(a, store))  # "a" decides round 0 and watches it
        for h in (b, c):  # its deputy (b or c) would race it for round 1's claim
            h._liveness.ahead = None
        assert json.loads(store.get(keys.result(0)) or b"{}")["closer"] == "a"
        flags = []
        for h in (a, b, c):
            flag, cb = _flag()
            h.set_change_callback(cb)
            flags.append(flag)
        d.leave()  # d is lost
        # "a" notices, claims round 1 to decide it at once for b and c (a 30 s last call
        # would otherwise hold the round), and dies at its first page: its claims end
        # with its lease. b and c re-form by joining, and one decides.
        assert dying.died.wait(5)
        assert all(f.wait(10) for f in flags)
        started = time.monotonic()
        second = _all([b, c])
        assert time.monotonic() - started < 20  # decided at once, not after the 30 s last call
        assert {i.world_size for i in second.values()} == {2}
        assert {i.round for i in second.values()} == {1}
        # The ranks a full re-join of b and c would give.
        full = order_members([Joiner(n, 0, first[n].rank) for n in ("b", "c")], 4)
        assert {n: second[n].rank for n in ("b", "c")} == {n: r for r, n in enumerate(full)}
        assert second["b"].bootstrap_store_info == second["c"].bootstrap_store_info
    finally:
        for h in (a, b, c):
            h.leave()


def test_a_loss_of_one_of_many_is_decided_by_one_survivor_and_the_rest_only_read() -> None:
    """Six nodes, one lost: every survivor keeps its rank, the last rank moves into the
    hole, and only the survivor that decides writes a join; the others read ``out/``."""
    store = MemoryStore()
    hs = [_node(store, n, 2, 6, last_call_timeout=30.0) for n in "abcdef"]
    keys = RunKeys.of_run("job")
    try:
        first = _all(hs)
        by_rank = sorted(hs, key=lambda h: first[NAMES[id(h)]].rank)
        lost = by_rank[1]
        survivors = [h for h in hs if h is not lost]
        flags = []
        for h in survivors:
            flag, cb = _flag()
            h.set_change_callback(cb)
            flags.append(flag)
        lost.leave()
        assert all(f.wait(5) for f in flags)
        decider = by_rank[0]
        one = _all([decider])  # decides alone, at once: the others are presumed
        rest = _all([h for h in survivors if h is not decider])
        second = {**one, **rest}
        moved = NAMES[id(by_rank[5])]
        for h in survivors:
            name = NAMES[id(h)]
            want = 1 if name == moved else first[name].rank
            assert second[name].rank == want and second[name].world_size == 5
        joins, _ = store.get_prefix(keys.join_prefix(1))
        assert list(joins) == [keys.join_prefix(1) + NAMES[id(decider)]]
    finally:
        for h in hs:
            if h is not lost:
                h.leave()


def test_a_lease_that_ended_behind_a_recent_acknowledgement_is_replaced_when_joining() -> None:
    store = MemoryStore()
    h = _node(store, "a", 1, 1)
    try:
        first = _all([h])
        lease = h._liveness.now.lease
        assert lease is not None
        store.revoke_lease(lease)  # ended since the last acknowledgement, moments ago
        second = _all([h])
        assert second["a"].round == first["a"].round + 1 and second["a"].rank == 0
        assert h._liveness.now.lease not in (None, lease)
    finally:
        h.leave()
