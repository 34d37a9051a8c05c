"""Who a re-formation decided at once may presume joined: exactly the members a full
re-join would have admitted (``decide_round``'s ``must_join``, read by ``RoundView``).

Each case is a way a live member of the previous round may not re-join at once: it
claimed that round's failure (and may be excluded, sit out a cool-down and be readmitted
before it joins, or close the run), it finished that round (its exit barrier decides
whether it re-forms or leaves), or it gave notice (``Away``: a signal, an agent that gave
up, a node check before it re-joins). Pure functions fed inputs."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import World
from elastrun.agent.spec import WorkerSpec
from elastrun.core.errors import RendezvousClosedError, ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.local_agent import LocalElasticAgent
from elastrun.rendezvous import entering
from elastrun.rendezvous.api import RendezvousInfo
from elastrun.rendezvous.decide import Away, Joiner, RoundView, Verdict, decide_round
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.running import RoundWatch
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.api import EventKind, WatchEvent
from elastrun.store.memory import MemoryStore
from elastrun.supervise.processes.logs import DefaultLogsSpecs
from elastrun.testing import FakeClock, FakeStarter, NullGuard

K = RunKeys("/elastrun/job/")
KW: dict[str, Any] = dict(now=0.0, call_started_at=None, last_call=30.0, join_deadline=600.0)


def _j(node: str, prev: int | None = None) -> Joiner:
    return Joiner(node, 0, prev)


def _put(key: str, value: bytes = b"{}") -> WatchEvent:
    return WatchEvent(EventKind.PUT, key, value, 0)


def _delete(key: str) -> WatchEvent:
    return WatchEvent(EventKind.DELETE, key, None, 0)


def _claim(node: str) -> bytes:
    return json.dumps({"node": node, "addr": "h", "what": "rank 1 exited 1"}).encode()


def _spare_view(n: int = 2, more: dict[str, bytes] | None = None) -> RoundView:
    """Round ``n`` forming after ``good`` and ``bad``'s round: ``spare`` waits at the
    maximum of two, and ``good`` has just joined (``more``: other keys read)."""
    view = RoundView(K, n, previous=("good", "bad"))
    joins = {K.join_prefix(n) + "spare": b"{}", K.join_prefix(n) + "good": b'{"prev_rank": 0}'}
    view.load(joins, [K.nodes + node for node in ("good", "bad", "spare")], None, (), more)
    return view


def _decide(view: RoundView, max_nodes: int = 2) -> tuple[Verdict, tuple[str, ...]]:
    class Bounds:
        min_nodes, max_nodes, last_call_timeout = 1, 0, 30.0

    bounds = Bounds()
    bounds.max_nodes = max_nodes
    d = view.decide(bounds, now=0.0, call_started_at=None, join_deadline=600.0)
    return d.verdict, d.members


# -- the node that claimed the previous round's failure ------------------------------------


def test_the_claimer_of_the_failure_is_not_presumed_and_the_spare_takes_its_place() -> None:
    previous = ("good", "bad")
    joiners = [_j("good", 0), _j("spare")]
    d = decide_round(
        joiners, {"good", "bad"}, min_nodes=2, max_nodes=2, first_round=False,
        previous=previous, must_join={"bad"}, **KW,
    )  # fmt: skip
    assert (d.verdict, d.members) == (Verdict.CLOSE, ("good", "spare"))
    # Without the claim "bad" would have been presumed, ahead of the spare.
    d = decide_round(
        joiners, {"good", "bad"}, min_nodes=2, max_nodes=2, first_round=False,
        previous=previous, **KW,
    )  # fmt: skip
    assert d.members == ("good", "bad")


def test_a_node_back_from_its_cool_down_is_not_presumed_ahead_of_the_spare() -> None:
    # "bad" claimed round 1's failure, was excluded, sat out its cool-down and was
    # readmitted (its exclusion deleted) before round 2 was decided; it has not joined.
    view = _spare_view()
    view.apply([_put(K.failed(1), _claim("bad")), _put(K.excluded("bad"))])
    assert _decide(view) == (Verdict.CLOSE, ("good", "spare"))
    view.apply([_delete(K.excluded("bad"))])
    assert view.must_join() == {"good", "bad"}  # the round failed: every member joins
    assert _decide(view) == (Verdict.CLOSE, ("good", "spare"))


def test_after_a_failed_round_a_member_that_died_whole_is_not_presumed_into_rank_0() -> None:
    # "dead" (rank 0) was killed with its workers: "good"'s workers failed at once, and
    # "good" claimed the failure and re-joined while "dead"'s lease still lived (the
    # store's disconnect grace). Presumed, "dead" would keep rank 0 and the round would
    # wait for a master address that never comes.
    view = RoundView(K, 2, previous=("dead", "good"))
    joins = {K.join_prefix(2) + "good": b'{"prev_rank": 1}'}
    failed = {K.failed(1): _claim("good")}
    view.load(joins, [K.nodes + node for node in ("dead", "good")], None, (), failed)
    assert _decide(view)[0] is Verdict.WAIT  # "dead" may still come, as a full re-join
    view.apply([_delete(K.nodes + "dead")])  # its lease ends
    assert _decide(view) == (Verdict.CLOSE, ("good",))
    # A lost lease with no failed round still decides at once, presuming the others.
    view = RoundView(K, 2, previous=("a", "good", "b"))
    view.load(joins, [K.nodes + node for node in ("a", "good", "b")], None, ())
    assert _decide(view, max_nodes=3) == (Verdict.CLOSE, ("a", "good", "b"))


def test_a_closer_that_reads_the_claim_in_its_first_reads_does_not_presume_the_claimer() -> None:
    view = _spare_view(more={K.failed(1): _claim("bad"), K.failed(10): _claim("good")})
    assert view.failed_by == "bad"  # (round 10's claim is no other round's)
    assert _decide(view) == (Verdict.CLOSE, ("good", "spare"))


def test_with_room_the_round_waits_for_the_claimer_to_join_itself_as_a_full_rejoin_would() -> None:
    view = _spare_view()
    view.apply([_put(K.failed(1), _claim("bad"))])
    verdict, _ = _decide(view, max_nodes=3)
    assert verdict is Verdict.WAIT  # the last call: "bad" may still come
    view.apply([_put(K.join_prefix(2) + "bad", b'{"prev_rank": 1}')])
    assert _decide(view, max_nodes=3) == (Verdict.CLOSE, ("good", "bad", "spare"))


def test_a_claim_of_an_older_round_does_not_keep_a_member_from_being_presumed() -> None:
    view = _spare_view(n=3)
    view.apply([_put(K.failed(1), _claim("bad"))])
    assert view.failed_by is None
    assert _decide(view) == (Verdict.CLOSE, ("good", "bad"))


def test_in_the_first_round_nothing_of_a_previous_round_is_read() -> None:
    view = RoundView(K, 0, previous=())
    view.apply([_put(K.failed(0), _claim("a")), _put(K.away("a"), Away(-1, "x").dump())])
    assert view.must_join() == set()


def test_newcomers_are_ordered_by_when_they_joined_not_by_their_ids() -> None:
    view = _spare_view()  # "spare" joined before this view was read
    late = WatchEvent(EventKind.PUT, K.join_prefix(2) + "a-newcomer", b"{}", 50)
    view.apply([_put(K.excluded("bad")), late])
    assert _decide(view, max_nodes=2) == (Verdict.CLOSE, ("good", "spare"))
    later = WatchEvent(EventKind.PUT, K.join_prefix(2) + "0-newcomer", b"{}", 51)
    view.apply([later])
    assert _decide(view, max_nodes=3)[1] == ("good", "spare", "a-newcomer")


# -- members that finished the previous round ---------------------------------------------


def test_a_member_in_the_exit_barrier_is_not_presumed_it_re_forms_only_when_told() -> None:
    view = _spare_view()
    view.apply([_delete(K.join_prefix(2) + "spare"), _put(K.done(1) + "bad", b"1")])
    verdict, _ = _decide(view, max_nodes=3)
    assert verdict is Verdict.WAIT
    # Its barrier timed out and it left: the round closes without it.
    view.apply([_delete(K.nodes + "bad")])
    assert _decide(view, max_nodes=3) == (Verdict.CLOSE, ("good",))


# -- members that gave notice ---------------------------------------------------------------


def test_a_member_stopping_on_a_signal_is_not_presumed_while_its_lease_lives_on() -> None:
    view = _spare_view()
    view.apply([_put(K.away("bad"), Away(1, "received SIGTERM").dump())])
    assert view.away == {"bad"}
    assert _decide(view) == (Verdict.CLOSE, ("good", "spare"))


def test_a_member_whose_agent_gave_up_is_waited_for_until_its_lease_ends() -> None:
    view = _spare_view()
    view.apply([_delete(K.join_prefix(2) + "spare")])
    view.apply([_put(K.away("bad"), Away(1, "no progress since the last restarts").dump())])
    assert _decide(view, max_nodes=3)[0] is Verdict.WAIT
    view.apply([_delete(K.nodes + "bad"), _delete(K.away("bad"))])
    assert _decide(view, max_nodes=3) == (Verdict.CLOSE, ("good",))


def test_a_notice_about_another_round_or_unreadable_does_not_count() -> None:
    view = _spare_view()
    view.apply([_put(K.away("bad"), Away(0, "old").dump()), _put(K.away("good"), b"junk")])
    assert view.away == set()
    assert _decide(view) == (Verdict.CLOSE, ("good", "bad"))
    assert Away.load(json.dumps({"v": 2, "round": 1}).encode()) is None
    assert Away.load(json.dumps({"v": 1, "round": True}).encode()) is None


def test_a_member_counted_in_that_is_then_excluded_makes_its_round_re_form() -> None:
    # Counted in before it joined, it ran its check first, failed it and sits out a
    # cool-down: it never comes, and the others must not wait for it.
    w = RoundWatch(K, 2, 2, 2, is_member=lambda node: node in ("good", "bad"))
    w.apply([_put(K.excluded("spare"))])  # a spare kept out: no one's business
    assert w.reason() is None
    w.apply([_put(K.excluded("bad"))])
    assert w.reason() == "member(s) kept out for a cool-down: bad"


# -- the handler: a notice written, and heeded ---------------------------------------------


def _node(store: MemoryStore, name: str, most: int = 3) -> DynamicRendezvousHandler:
    settings = RendezvousSettings("job", 1, most, last_call_timeout=30.0)
    return DynamicRendezvousHandler(store, settings, NodeDesc(name, "127.0.0.1", "default", 1))


def _join_all(
    nodes: dict[str, DynamicRendezvousHandler],
    closer: str | None = None,
    store: MemoryStore | None = None,
) -> dict[str, RendezvousInfo]:
    """Every node joins round 0; ``closer`` first, and the others once it holds the
    round's claim (it decides, and so watches the round for the others)."""
    out: dict[str, RendezvousInfo] = {}

    def go(name: str) -> None:
        out[name] = nodes[name].next_rendezvous()

    order = sorted(nodes, key=lambda n: n != closer)
    threads = [threading.Thread(target=go, args=(n,), daemon=True) for n in order]
    for thread in threads:
        thread.start()
        if store is not None and thread is threads[0]:
            _wait_for(lambda: store.get(K.closer(0)) is not None, "the first node's claim")
    for thread in threads:
        thread.join(10)
    assert set(out) == set(nodes)
    return out


def test_a_member_that_steps_away_is_waited_for_not_counted_in_until_its_lease_ends() -> None:
    store = MemoryStore()
    nodes = {n: _node(store, n) for n in ("a", "b", "c")}
    try:
        # "c" decides round 0, so it watches the round: after its notice it must not
        # join the next round ahead either.
        _join_all(nodes, "c", store)
        nodes["c"].step_away("received SIGTERM")  # its workers stop next
        assert Away.load(store.get(K.away("c"))) == 0
        nodes["b"].leave()  # lost: "a" re-forms and decides round 1
        started = time.monotonic()
        second: list[RendezvousInfo] = []
        joining = threading.Thread(target=lambda: second.append(nodes["a"].next_rendezvous()))
        joining.start()
        joining.join(0.5)
        assert not second  # "c" is not counted in: the round waits for its join
        nodes["c"].leave()  # its lease ends: the round closes without it, at once
        joining.join(10)
        assert second[0].world_size == 1 and second[0].round == 1
        assert time.monotonic() - started < 20  # not after the 30 s last call
    finally:
        for node in nodes.values():
            node.leave()


def _wait_for(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_rank_0_counted_in_alive_that_dies_before_its_address_moves_the_others_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two nodes lost at once (a rack): the first lease ends and the survivors re-form at
    # once, counting in rank 0, whose lease still lives (the store's disconnect grace);
    # then it ends too. Rank 0 never writes the master address: the others must not wait
    # for it until the join timeout (600 s by default), but move on to the next round.
    monkeypatch.setattr(entering, "MASTER_CHECK_EVERY", 0.2)
    store = MemoryStore()
    nodes = {n: _node(store, n) for n in ("a", "b", "c")}
    try:
        first = _join_all(nodes)
        by_rank = sorted(nodes, key=lambda n: first[n].rank)
        head, other, survivor = by_rank[0], by_rank[1], by_rank[2]
        # The head's process is dying: it decides nothing ahead (a head deciding round 1
        # writes its address with the decision) and never joins.
        nodes[head]._liveness.ahead = None
        nodes[other].leave()  # lost: the survivor decides round 1, counting the head in
        second: list[RendezvousInfo] = []
        joining_thread = threading.Thread(
            target=lambda: second.append(nodes[survivor].next_rendezvous()), daemon=True
        )
        joining_thread.start()
        _wait_for(lambda: store.get(K.result(1)) is not None, "round 1 decided")
        result = json.loads(store.get(K.result(1)) or b"{}")
        assert result["head"] == head and result["size"] == 2  # the head counted in
        started = time.monotonic()
        nodes[head].leave()  # its lease ends before it gave its address
        joining_thread.join(10)
        assert second, "the survivor still waits for the dead head's address"
        assert (second[0].round, second[0].rank, second[0].world_size) == (2, 0, 1)
        assert time.monotonic() - started < 5
        assert store.get(K.master(1)) is None
    finally:
        for node in nodes.values():
            node.leave()


def test_a_node_readmitted_before_the_next_round_is_decided_joins_behind_the_spare() -> None:
    store = MemoryStore()
    nodes = {n: _node(store, n, most=2) for n in ("a", "b", "spare")}
    out: dict[str, RendezvousInfo] = {}
    threads: list[threading.Thread] = []

    def join(name: str) -> threading.Thread:
        def go() -> None:
            with contextlib.suppress(RendezvousClosedError):  # (left while a spare)
                out[name] = nodes[name].next_rendezvous()

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    try:
        # Round 0, at its maximum, decided by "b", which is then kept out: it does not
        # decide round 1 ahead. Its deputy "a" re-forms only when its agent joins, later
        # here (as a quiet member of a larger round would; a deputy decides ahead).
        nodes["a"]._liveness.ahead = None
        first = _join_all({n: nodes[n] for n in ("a", "b")}, "b", store)
        join("spare")  # waits for room in round 1, and decides it
        _wait_for(lambda: store.get(K.closer(1)) == b"spare", "the spare's claim")
        assert nodes["b"].exclusions.exclude("its node check failed") is not None
        nodes["b"].exclusions.readmit()  # its cool-down is over before "a" re-forms
        join("b")
        _wait_for(lambda: store.get(K.result(1)) is not None, "round 1 decided")
        joined = json.loads(store.get(K.join_prefix(1) + "b") or b"{}")
        assert joined["prev_rank"] is None  # a newcomer, not round 0's rank 1
        join("a").join(10)
        _wait_for(lambda: "spare" in out, "the spare's rank")
        # "a" keeps its rank, the spare takes "b"'s.
        assert (out["a"].rank, out["spare"].rank) == (first["a"].rank, first["b"].rank)
        assert "b" not in out  # a spare now, waiting for room in round 2
    finally:
        for node in nodes.values():
            node.leave()
        for thread in threads:
            thread.join(10)


def test_a_node_outside_any_round_gives_no_notice() -> None:
    store = MemoryStore()
    node = _node(store, "a")
    try:
        node.step_away("received SIGTERM")
        assert store.get(K.away("a")) is None
    finally:
        node.leave()


def test_an_agent_stopped_by_a_signal_gives_notice_before_its_workers_stop(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    handler = _node(store, "a", most=1)
    request = ShutdownRequest()
    notice_at_stop: list[bytes | None] = []
    starter = FakeStarter(script=lambda a, r: None)
    original = starter.start

    def start_then_signal(spec):  # type: ignore[no-untyped-def]  # wraps the fake's start
        proc = original(spec)
        stop = proc.signal_group

        def signal_group(sig: int) -> None:
            notice_at_stop.append(store.get(K.away("a")))
            stop(sig)

        proc.signal_group = signal_group  # type: ignore[method-assign]  # a fake's method, wrapped
        request.request(signal.SIGTERM)
        return proc

    starter.start = start_then_signal  # type: ignore[method-assign]  # a fake's method, wrapped
    spec = WorkerSpec(local_world_size=1, entrypoint="/bin/prog", rdzv_handler=handler)
    agent = LocalElasticAgent(
        spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        options=AgentOptions(environ={}, run_id="job"),
        world=World(starter=starter, guard=NullGuard(), clock=FakeClock(), shutdown=request),
    )  # fmt: skip
    try:
        with pytest.raises(ShutdownRequested):
            agent.run()
        assert notice_at_stop and Away.load(notice_at_stop[0]) == 0
    finally:
        request.close()
        handler.leave()


# -- the property ---------------------------------------------------------------------------

_NODES = [f"n{i}" for i in range(8)]


@given(
    st.lists(st.sampled_from(_NODES), min_size=1, max_size=8, unique=True),
    st.sets(st.sampled_from(_NODES)),  # lost
    st.sets(st.sampled_from(_NODES)),  # must join themselves
    st.sets(st.sampled_from(_NODES)),  # excluded
    st.sets(st.sampled_from(_NODES)),  # joined (of the previous members)
    st.integers(0, 3),  # spares
    st.integers(1, 10),  # max nodes
)
def test_a_decision_at_once_is_the_decision_of_the_full_rejoin_of_every_presumable_member(
    previous: list[str],
    lost: set[str],
    must_join: set[str],
    excluded: set[str],
    joined: set[str],
    spares: int,
    max_nodes: int,
) -> None:
    live = set(previous) - lost
    rank = {node: i for i, node in enumerate(previous)}
    joiners = [_j(n, rank[n]) for n in previous if n in live & joined]
    joiners += [_j(f"s{i}") for i in range(spares)]
    args: dict[str, Any] = dict(
        min_nodes=1, max_nodes=max_nodes, first_round=False, excluded=excluded, **KW
    )
    at_once = decide_round(joiners, live, previous=previous, must_join=must_join, **args)
    if (live - excluded) and not (live - excluded) & joined:
        assert at_once.verdict is Verdict.WAIT  # spares alone start nothing
        return
    # The full re-join: every live member that may be presumed has joined; the others
    # (must join themselves, or excluded) have not.
    came = [
        _j(n, rank[n])
        for n in previous
        if n in live and n not in joined and n not in must_join and n not in excluded
    ]
    full = decide_round([*joiners, *came], live, **args)
    assert (at_once.verdict, at_once.members) == (full.verdict, full.members)
    assert not set(at_once.members) & ((must_join - joined) | excluded)
