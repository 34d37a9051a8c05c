"""The store model's deadlines (``store.api``), pinned for every implementation.

A call made in a cancel scope with a deadline -- the scope it is handed, or the thread's
current one -- ends by that deadline with ``StoreTimeoutError``, and the store goes on
working. Calls that never wait (the memory store's) are not asked to fail: the tests
use waits that nothing will answer. Bounds on "how soon" are generous because the suite
shares a small machine.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import pytest

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Deadline
from elastrun.core.errors import StoreTimeoutError
from elastrun.store.api import Store

if TYPE_CHECKING:  # the fixtures' types; conftest is not importable by name at run time
    from contract.conftest import StoreKit

DEADLINE = 0.4
#: How far past its deadline a call may end on a loaded machine.
LATE = 0.8


def _scope(seconds: float = DEADLINE) -> CancelScope:
    return CancelScope(deadline=Deadline.after(seconds))


def _still_works(store: Store) -> None:
    """The same client goes on: a write, then a watch that sees it."""
    _, rev = store.get_prefix("dl/")
    store.set("dl/after", b"1")
    assert [e.key for e in store.watch("dl/", rev, 5.0).events] == ["dl/after"]


def test_a_watch_ends_at_its_scopes_deadline_with_store_timeout(store: Store) -> None:
    _, rev = store.get_prefix("dl/")
    t0 = time.monotonic()
    with _scope() as scope, pytest.raises(StoreTimeoutError):
        store.watch("dl/", rev, 30.0, scope=scope)
    took = time.monotonic() - t0
    assert DEADLINE - 0.05 <= took < DEADLINE + LATE, took
    _still_works(store)


def test_a_wait_ends_at_its_scopes_deadline_with_store_timeout(store: Store) -> None:
    t0 = time.monotonic()
    with _scope() as scope, pytest.raises(StoreTimeoutError):
        store.wait(["dl/never"], 30.0, scope=scope)
    took = time.monotonic() - t0
    assert DEADLINE - 0.05 <= took < DEADLINE + LATE, took
    _still_works(store)


def test_the_current_scopes_deadline_ends_a_watch_handed_no_scope(store: Store) -> None:
    _, rev = store.get_prefix("dl/")
    t0 = time.monotonic()
    with _scope() as scope, scope.active(), pytest.raises(StoreTimeoutError):
        store.watch("dl/", rev, 30.0)
    assert time.monotonic() - t0 < DEADLINE + LATE
    _still_works(store)


def test_a_scope_whose_deadline_passed_ends_a_wait_without_waiting(store: Store) -> None:
    _, rev = store.get_prefix("dl/")
    with _scope(0.0) as scope:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            store.watch("dl/", rev, 30.0, scope=scope)
        with pytest.raises(StoreTimeoutError):
            store.wait(["dl/never"], 30.0, scope=scope)
        assert time.monotonic() - t0 < LATE
    _still_works(store)


def test_a_watch_timeout_shorter_than_the_deadline_still_returns_empty(store: Store) -> None:
    _, rev = store.get_prefix("dl/")
    with _scope(10.0) as scope:
        result = store.watch("dl/", rev, 0.3, scope=scope)
    assert result.events == ()


def test_calls_in_a_scope_with_time_left_work_as_usual(store: Store) -> None:
    with _scope(10.0) as scope, scope.active():
        lease = store.grant_lease(5.0)
        store.set("dl/k", b"v", lease=lease)
        assert store.keep_alive(lease) is True
        assert store.get("dl/k") == b"v"
        assert store.compare_set("dl/k", b"v", b"w", lease=lease) == (True, b"w")
        store.wait(["dl/k"], 5.0)
        store.revoke_lease(lease)
    assert store.get("dl/k") is None


def test_a_change_before_the_deadline_is_returned(kit: StoreKit) -> None:
    writer, watcher = kit.client(), kit.client()
    _, rev = watcher.get_prefix("dl/")
    timer = threading.Timer(0.1, writer.set, args=("dl/x", b"1"))
    timer.start()
    with _scope(5.0) as scope:
        result = watcher.watch("dl/", rev, 30.0, scope=scope)
    timer.join()
    assert [e.key for e in result.events] == ["dl/x"]
