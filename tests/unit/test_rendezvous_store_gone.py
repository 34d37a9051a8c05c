"""The dynamic rendezvous gives up a store its client has given up: one line, for good.

A store that raises ``StoreUnavailableError`` on demand stands for a client whose
reconnect window ran out (``read_timeout`` after the store went silent).
"""

from __future__ import annotations

import threading

import pytest

from elastrun.core.errors import RendezvousConnectionError, StoreUnavailableError
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.memory import MemoryStore

LINE = "the rendezvous store at 127.0.0.1:29400 stopped answering 60s ago; stopping"


class DyingStore(MemoryStore):
    """A memory store that, once ``die()`` is called, fails every call as given up."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = threading.Event()
        self.calls_after_death: list[str] = []

    def die(self) -> None:
        self.dead.set()

    def _check(self, op: str) -> None:
        if self.dead.is_set():
            self.calls_after_death.append(op)
            raise StoreUnavailableError(
                "cannot reach the store at 127.0.0.1:29400: Connection refused; "
                "it has not answered for 60s",
                address="127.0.0.1:29400",
                silent_for=60.2,
            )

    def get(self, key: str) -> bytes | None:
        self._check("get")
        return super().get(key)

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        self._check("compare_set")
        return super().compare_set(key, expected, value, lease=lease)

    def keep_alive(self, lease: int) -> bool:
        self._check("keep_alive")
        return super().keep_alive(lease)

    def revoke_lease(self, lease: int) -> None:
        self._check("revoke_lease")
        super().revoke_lease(lease)


def _handler(store: DyingStore) -> DynamicRendezvousHandler:
    settings = RendezvousSettings("job", 1, 2, last_call_timeout=0.05, heartbeat_timeout=30)
    return DynamicRendezvousHandler(store, settings, NodeDesc("a", "127.0.0.1", "default", 1))


def test_a_given_up_store_ends_the_rendezvous_with_one_line_and_no_more_calls() -> None:
    store = DyingStore()
    handler = _handler(store)
    woken = threading.Event()
    handler.set_change_callback(woken.set)
    try:
        handler.next_rendezvous()
        assert handler.num_nodes_waiting() == 0
        store.die()
        with pytest.raises(RendezvousConnectionError) as caught:
            handler.next_rendezvous()
        assert str(caught.value) == LINE
        assert woken.is_set()  # the agent's loop is woken to act on it
        # From now on every question ends the same way, without asking the store.
        calls = len(store.calls_after_death)
        with pytest.raises(RendezvousConnectionError, match="stopped answering 60s ago"):
            handler.num_nodes_waiting()
        with pytest.raises(RendezvousConnectionError, match="stopped answering 60s ago"):
            handler.next_rendezvous()
        assert handler.shutdown() is False  # nothing to close, nothing to revoke
        assert len(store.calls_after_death) == calls
    finally:
        handler.leave()
