"""What a user's code sees of a rendezvous made through elastrun's handler registry.

The same path ``LaunchConfig`` and ``--rdzv-backend c10d`` take: parameters in, a
handler out, a real tcp store on 127.0.0.1 served by the first handler. Each test pins
one user-visible rule of the handler API (torch's ``RendezvousHandler``): ranks and world
size, closing, shutdown, the "nodes waiting" signal, and torch's store-sharing switch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest

from _helpers import free_port, wait_for
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters
from elastrun.rendezvous.registry import rendezvous_handler_registry

#: Bounds a test that would otherwise hang; no test asserts on speed.
WAIT = 30.0


Make = Callable[..., RendezvousHandler]


@pytest.fixture
def make() -> Iterator[Make]:
    """``make(min, max, is_host=..., **conf)``: a c10d handler from the registry; every
    handler made is shut down (and its store stopped) after the test."""
    port = free_port()
    made: list[RendezvousHandler] = []

    def _make(min_nodes: int = 2, max_nodes: int = 2, **conf: object) -> RendezvousHandler:
        conf.setdefault("is_host", "false" if made else "true")
        conf.setdefault("close_timeout", 2)
        # Values as torch's users pass them, ints too: the get_as_* readers convert them.
        options = cast("dict[str, str]", conf)
        params = RendezvousParameters(
            "c10d", f"127.0.0.1:{port}", "semantics", min_nodes, max_nodes, "127.0.0.1", **options
        )
        handler = rendezvous_handler_registry.create_handler(params)
        made.append(handler)
        return handler

    yield _make
    with ThreadPoolExecutor(len(made) or 1) as pool:  # the host waits for the others
        list(pool.map(lambda h: h.shutdown(), reversed(made)))


def _join_all(*handlers: RendezvousHandler) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=WAIT) for f in futures]


def test_two_handlers_get_distinct_ranks_and_world_size_two(make: Make) -> None:
    infos = _join_all(make(), make())
    assert sorted(info.rank for info in infos) == [0, 1]
    assert {info.world_size for info in infos} == {2}


def test_set_closed_closes_the_run_for_every_node_and_may_be_called_again(make: Make) -> None:
    first, second = make(), make()
    _join_all(first, second)
    assert not first.is_closed() and not second.is_closed()
    first.set_closed()
    first.set_closed()  # idempotent: no error, still closed
    assert first.is_closed() and second.is_closed()


def test_shutdown_returns_true_and_closes_the_run(make: Make) -> None:
    first, second = make(), make()
    _join_all(first, second)
    assert second.shutdown() is True
    assert first.is_closed()


def test_num_nodes_waiting_is_zero_in_a_full_round_and_positive_when_a_node_waits(
    make: Make,
) -> None:
    # Two of up to three nodes: the round completes at the last call (1 s here).
    first, second = make(2, 3, last_call_timeout=1), make(2, 3, last_call_timeout=1)
    _join_all(first, second)
    assert first.num_nodes_waiting() == 0 and second.num_nodes_waiting() == 0
    third = make(2, 3, last_call_timeout=1)
    late = threading.Thread(target=_join_quietly, args=(third,), daemon=True)
    late.start()
    wait_for(lambda: first.num_nodes_waiting() > 0, WAIT, "the waiting node to be seen")
    wait_for(lambda: second.num_nodes_waiting() > 0, WAIT, "the waiting node to be seen")
    infos = _join_all(first, second)  # re-form with the waiting node
    late.join(WAIT)
    assert {info.world_size for info in infos} == {3}


def _join_quietly(handler: RendezvousHandler) -> None:
    handler.next_rendezvous()


def test_torchs_switch_to_not_share_the_rendezvous_store_is_accepted(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun's workaround for its shared store (reference: a deadlock at scale-up);
    # elastrun gives every round a fresh bootstrap store, so it changes nothing.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    infos = _join_all(make(), make())
    assert sorted(info.rank for info in infos) == [0, 1]
