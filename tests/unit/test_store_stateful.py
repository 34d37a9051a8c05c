"""Every store implementation behaves like a plain dict under any sequence of operations.

Hypothesis drives random sequences of set/get/add/compare_set/delete/get_prefix against
the store and against a dict; after every step they must agree, revisions must only
grow, and replaying the store's own change history must rebuild the dict.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from elastrun.core.errors import StoreError
from elastrun.store.api import EventKind, Store
from elastrun.store.memory import MemoryStore
from elastrun.store.tcp import TcpStore, TcpStoreServer

KEYS = st.sampled_from(["a", "ab", "b", "b/c", "b/d", "c"])
PREFIXES = st.sampled_from(["", "a", "b", "b/", "zz"])
VALUES = st.one_of(
    st.integers(-1000, 1000).map(lambda i: str(i).encode()),
    st.binary(max_size=6),
)
CURRENT = object()  # "expect whatever the key holds now"


class StoreMatchesDict(RuleBasedStateMachine):
    """One store, one namespace of keys, and the dict it must agree with."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.ns = f"m{uuid.uuid4().hex[:8]}/"  # examples may share one server
        self.model: dict[str, bytes] = {}
        self.start = store.get_prefix(self.ns)[1]
        self.revision = self.start

    def _grew(self, revision: int) -> None:
        assert revision > self.revision
        self.revision = revision

    @rule(key=KEYS, value=VALUES)
    def set(self, key: str, value: bytes) -> None:
        self._grew(self.store.set(self.ns + key, value))
        self.model[key] = value

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        assert self.store.get(self.ns + key) == self.model.get(key)

    @rule(key=KEYS, amount=st.integers(-50, 50))
    def add(self, key: str, amount: int) -> None:
        try:
            expected = int(self.model.get(key, b"0")) + amount
        except ValueError:
            with pytest.raises(StoreError):
                self.store.add(self.ns + key, amount)
            return
        assert self.store.add(self.ns + key, amount) == expected
        self.model[key] = str(expected).encode()

    @rule(key=KEYS, expected=st.one_of(st.none(), VALUES, st.just(CURRENT)), value=VALUES)
    def compare_set(self, key: str, expected: object, value: bytes) -> None:
        wanted = self.model.get(key) if expected is CURRENT else expected
        assert wanted is None or isinstance(wanted, bytes)
        swapped, current = self.store.compare_set(self.ns + key, wanted, value)
        assert swapped == (self.model.get(key) == wanted)
        if swapped:
            self.model[key] = value
        assert current == self.model.get(key)

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        assert self.store.delete(self.ns + key) == (key in self.model)
        self.model.pop(key, None)

    @rule(prefix=PREFIXES)
    def get_prefix(self, prefix: str) -> None:
        found, revision = self.store.get_prefix(self.ns + prefix)
        expected = {self.ns + k: v for k, v in self.model.items() if k.startswith(prefix)}
        assert found == expected
        assert revision >= self.revision
        self.revision = revision

    @rule()
    def history_replays_to_the_model(self) -> None:
        replayed: dict[str, bytes] = {}
        for event in self.store.watch(self.ns, self.start, 0).events:
            key = event.key[len(self.ns) :]
            if event.kind is EventKind.PUT:
                assert event.value is not None
                replayed[key] = event.value
            else:
                replayed.pop(key, None)
        assert replayed == self.model

    def teardown(self) -> None:
        self.store.close()


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[TcpStoreServer]:
    server = TcpStoreServer("127.0.0.1", 0)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("kind", ["memory", "tcp"])
def test_every_store_agrees_with_a_dict_under_random_operations(
    kind: str, request: pytest.FixtureRequest
) -> None:
    new_store: Callable[[], Store]
    if kind == "memory":
        new_store = MemoryStore
        examples = 100
    else:
        port = request.getfixturevalue("tcp_server").port
        new_store = lambda: TcpStore("127.0.0.1", port, connect_timeout=5.0)  # noqa: E731
        examples = 60

    class OnThisStore(StoreMatchesDict):  # hypothesis takes the machine's class
        def __init__(self) -> None:
            super().__init__(new_store())

    run_state_machine_as_test(
        OnThisStore,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
