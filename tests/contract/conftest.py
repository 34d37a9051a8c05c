"""Every implementation of the store model as fixtures: the tests here run against each.

A *kit* is one store and a way to get clients of it: the memory store hands out itself,
the tcp kit starts an in-process server thread and gives each caller its own
connection, so "two agents" are really two clients. The etcd kit joins the list when
that implementation exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from elastrun.store.api import Store
from elastrun.store.memory import HISTORY, MemoryStore
from elastrun.store.tcp import TcpStore, TcpStoreServer

IMPLEMENTATIONS = ["memory", "tcp"]


class StoreKit:
    """One store under test; ``client()`` gives another handle on the same data."""

    name = "?"

    def client(self) -> Store:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class MemoryKit(StoreKit):
    name = "memory"

    def __init__(self, history: int) -> None:
        self.store = MemoryStore(history=history)

    def client(self) -> Store:
        return self.store

    def close(self) -> None:
        self.store.close()


class TcpKit(StoreKit):
    name = "tcp"

    def __init__(self, history: int) -> None:
        self.server = TcpStoreServer("127.0.0.1", 0, history=history)
        self.server.start()
        self._clients: list[TcpStore] = []

    def client(self) -> Store:
        client = TcpStore("127.0.0.1", self.server.port, connect_timeout=5.0)
        self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.server.stop()


KITS: dict[str, Callable[[int], StoreKit]] = {"memory": MemoryKit, "tcp": TcpKit}

MakeKit = Callable[..., StoreKit]


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("elastrun-store")}


@pytest.fixture(params=IMPLEMENTATIONS)
def make_kit(request: pytest.FixtureRequest) -> Iterator[MakeKit]:
    """Build kits of the parametrized implementation (``history=`` bounds the log)."""
    before = _store_threads()
    kits: list[StoreKit] = []

    def make(history: int = HISTORY) -> StoreKit:
        kit = KITS[request.param](history)
        kits.append(kit)
        return kit

    yield make
    for kit in kits:
        kit.close()
    leaked = _store_threads() - before
    assert not leaked, f"store threads left running: {leaked}"


@pytest.fixture
def kit(make_kit: MakeKit) -> StoreKit:
    return make_kit()


@pytest.fixture
def store(kit: StoreKit) -> Store:
    return kit.client()
