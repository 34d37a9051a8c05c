"""The store model's contract (DESIGN.md section 3), pinned for every implementation.

Real time, short TTLs: the same test must hold for an in-process store and a server
behind a socket, so no fake clock. Bounds on "how soon" are generous because the
suite shares a small machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import (
    LeaseExpiredError,
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import EventKind, Store, WatchEvent

if TYPE_CHECKING:  # the fixtures' types; conftest is not importable by name at run time
    # (mypy names this directory's conftest contract.conftest: pyproject's mypy_path)
    from contract.conftest import MakeKit, StoreKit

TTL = 0.3
#: Long enough after a TTL for any implementation to have dropped the lease.
AFTER_TTL = 0.7


def in_thread(fn: Callable[[], object], delay: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def kinds(events: tuple[WatchEvent, ...]) -> list[tuple[EventKind, str, bytes | None]]:
    return [(e.kind, e.key, e.value) for e in events]


# -- keys and values ---------------------------------------------------------------------


def test_every_implementation_satisfies_the_store_protocol(store: Store) -> None:
    assert isinstance(store, Store)


def test_a_missing_key_reads_as_none(store: Store) -> None:
    assert store.get("nothing/here") is None


def test_set_then_get_returns_the_value_and_each_write_gets_a_higher_revision(
    store: Store,
) -> None:
    first = store.set("a", b"1")
    second = store.set("a", b"2")
    assert second > first
    assert store.get("a") == b"2"


def test_values_are_arbitrary_bytes_and_keys_arbitrary_text(store: Store) -> None:
    every_byte = bytes(range(256))
    store.set("bin", every_byte)
    store.set("empty", b"")
    store.set("ключ/🔑", b"unicode key")
    assert store.get("bin") == every_byte
    assert store.get("empty") == b""
    assert store.get("ключ/🔑") == b"unicode key"


def test_get_prefix_returns_only_keys_under_the_prefix_and_the_current_revision(
    store: Store,
) -> None:
    store.set("job/a", b"1")
    store.set("job/b", b"2")
    store.set("jobs", b"not under job/")
    last = store.set("other", b"3")
    found, revision = store.get_prefix("job/")
    assert found == {"job/a": b"1", "job/b": b"2"}
    assert revision == last
    assert store.get_prefix("nope/") == ({}, last)


def test_delete_reports_whether_the_key_existed(store: Store) -> None:
    store.set("k", b"v")
    assert store.delete("k") is True
    assert store.get("k") is None
    assert store.delete("k") is False


# -- add ---------------------------------------------------------------------------------


def test_add_counts_from_zero_and_returns_the_new_value(store: Store) -> None:
    assert store.add("counter", 1) == 1
    assert store.add("counter", 5) == 6
    assert store.add("counter", -10) == -4
    assert store.get("counter") == b"-4"


def test_add_on_a_non_integer_value_raises_store_error_and_changes_nothing(
    store: Store,
) -> None:
    store.set("word", b"hello")
    with pytest.raises(StoreError, match="not an integer"):
        store.add("word", 1)
    assert store.get("word") == b"hello"


def test_add_is_atomic_under_concurrent_clients(kit: StoreKit) -> None:
    clients = [kit.client() for _ in range(4)]

    def bump(client: Store) -> None:
        for _ in range(50):
            client.add("n", 1)

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clients[0].get("n") == b"400"


# -- compare_set -------------------------------------------------------------------------


def test_compare_set_with_expected_absence_creates_only_a_missing_key(store: Store) -> None:
    assert store.compare_set("k", None, b"first") == (True, b"first")
    assert store.compare_set("k", None, b"second") == (False, b"first")
    assert store.get("k") == b"first"


def test_compare_set_swaps_only_on_the_expected_value(store: Store) -> None:
    store.set("k", b"a")
    assert store.compare_set("k", b"wrong", b"b") == (False, b"a")
    assert store.compare_set("k", b"a", b"b") == (True, b"b")
    assert store.get("k") == b"b"


def test_compare_set_expecting_a_value_fails_on_a_missing_key(store: Store) -> None:
    assert store.compare_set("k", b"a", b"b") == (False, None)
    assert store.get("k") is None


def test_exactly_one_of_many_racing_compare_sets_wins(kit: StoreKit) -> None:
    clients = [kit.client() for _ in range(8)]
    wins: list[bool] = []

    def race(client: Store, me: int) -> None:
        won, _ = client.compare_set("leader", None, str(me).encode())
        wins.append(won)

    threads = [threading.Thread(target=race, args=(c, i)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wins.count(True) == 1


# -- leases ------------------------------------------------------------------------------


def test_granting_a_lease_needs_a_positive_finite_ttl(store: Store) -> None:
    # NaN and infinity too: a lease that never expires would hold its keys for good.
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(StoreError, match="positive, finite ttl"):
            store.grant_lease(ttl)


def test_keys_bound_to_a_revoked_lease_vanish_with_delete_events(store: Store) -> None:
    lease = store.grant_lease(30)
    store.set("members/a", b"1", lease=lease)
    store.set("members/b", b"2", lease=lease)
    store.set("members/static", b"3")
    _, revision = store.get_prefix("")
    store.revoke_lease(lease)
    assert store.get_prefix("members/")[0] == {"members/static": b"3"}
    result = store.watch("members/", revision, 1.0)
    assert sorted((e.kind, e.key) for e in result.events) == [
        (EventKind.DELETE, "members/a"),
        (EventKind.DELETE, "members/b"),
    ]


def test_revoking_an_unknown_lease_is_ignored(store: Store) -> None:
    store.revoke_lease(987_654)


def test_keep_alive_on_a_revoked_or_unknown_lease_returns_false(store: Store) -> None:
    lease = store.grant_lease(30)
    assert store.keep_alive(lease) is True
    store.revoke_lease(lease)
    assert store.keep_alive(lease) is False
    assert store.keep_alive(987_654) is False


def test_writing_with_a_revoked_lease_raises_lease_expired(store: Store) -> None:
    lease = store.grant_lease(30)
    store.revoke_lease(lease)
    with pytest.raises(LeaseExpiredError):
        store.set("k", b"v", lease=lease)
    with pytest.raises(LeaseExpiredError):
        store.compare_set("k", None, b"v", lease=lease)
    assert store.get("k") is None


def test_a_lease_not_kept_alive_expires_after_its_ttl_with_its_keys(store: Store) -> None:
    lease = store.grant_lease(TTL)
    store.set("alive", b"1", lease=lease)
    assert store.get("alive") == b"1"
    time.sleep(AFTER_TTL)
    assert store.get("alive") is None
    assert store.keep_alive(lease) is False
    with pytest.raises(LeaseExpiredError):
        store.set("alive", b"again", lease=lease)


def test_keep_alive_holds_a_lease_past_its_ttl(store: Store) -> None:
    lease = store.grant_lease(0.8)
    store.set("alive", b"1", lease=lease)
    end = time.monotonic() + 1.2
    while time.monotonic() < end:
        assert store.keep_alive(lease) is True
        time.sleep(0.1)
    assert store.get("alive") == b"1"
    store.revoke_lease(lease)


def test_rewriting_a_leased_key_without_a_lease_unbinds_it(store: Store) -> None:
    lease = store.grant_lease(30)
    store.set("k", b"leased", lease=lease)
    store.set("k", b"free")
    store.revoke_lease(lease)
    assert store.get("k") == b"free"


def test_add_keeps_the_lease_of_a_leased_counter(store: Store) -> None:
    lease = store.grant_lease(30)
    store.set("n", b"1", lease=lease)
    assert store.add("n", 1) == 2
    store.revoke_lease(lease)
    assert store.get("n") is None


def test_a_watch_hears_of_a_lease_expiry_without_any_other_traffic(kit: StoreKit) -> None:
    writer, watcher = kit.client(), kit.client()
    lease = writer.grant_lease(TTL)
    revision = writer.set("members/a", b"1", lease=lease)
    started = time.monotonic()
    result = watcher.watch("members/", revision, 5.0)
    assert kinds(result.events) == [(EventKind.DELETE, "members/a", None)]
    assert time.monotonic() - started < 3.0


# -- watch -------------------------------------------------------------------------------


def test_watch_returns_changes_under_the_prefix_in_revision_order(store: Store) -> None:
    start = store.set("unrelated", b"0")
    store.set("job/a", b"1")
    store.set("other/x", b"2")
    store.set("job/b", b"3")
    store.delete("job/a")
    result = store.watch("job/", start, 1.0)
    assert kinds(result.events) == [
        (EventKind.PUT, "job/a", b"1"),
        (EventKind.PUT, "job/b", b"3"),
        (EventKind.DELETE, "job/a", None),
    ]
    revisions = [e.revision for e in result.events]
    assert revisions == sorted(revisions)
    assert result.revision == revisions[-1]


def test_prefixes_that_end_inside_a_key_name_or_span_folders_find_exactly_their_keys(
    store: Store,
) -> None:
    start = store.set("run/ctl/nodes/a1", b"1")
    store.set("run/ctl/nodes/b2", b"2")
    store.set("run/ctl/join/0/a1", b"3")
    store.set("run/rounds/0/out/result", b"4")
    store.delete("run/ctl/nodes/b2")
    assert set(store.get_prefix("run/ctl/nodes/a")[0]) == {"run/ctl/nodes/a1"}
    assert set(store.get_prefix("run/ctl/")[0]) == {"run/ctl/nodes/a1", "run/ctl/join/0/a1"}
    assert set(store.get_prefix("run/ctl/j")[0]) == {"run/ctl/join/0/a1"}
    assert store.get_prefix("run/ctl/nodes/b")[0] == {}
    assert [e.key for e in store.watch("run/ctl/nodes/b", start, 0).events] == [
        "run/ctl/nodes/b2"
    ] * 2
    assert [e.key for e in store.watch("run/c", start, 0).events] == [
        "run/ctl/nodes/b2", "run/ctl/join/0/a1", "run/ctl/nodes/b2",
    ]  # fmt: skip
    quiet = store.watch("run/rounds/1/", start, 0)  # nothing there: nothing new
    assert quiet.events == ()


def test_watch_with_nothing_new_times_out_empty_at_the_current_revision(store: Store) -> None:
    current = store.set("k", b"v")
    started = time.monotonic()
    result = store.watch("k", current, 0.3)
    assert result.events == ()
    assert result.revision == current
    assert time.monotonic() - started >= 0.25


def test_watch_with_zero_timeout_does_not_block(store: Store) -> None:
    current = store.set("k", b"v")
    started = time.monotonic()
    assert store.watch("k", current, 0).events == ()
    # A watch that blocked would wait for an event that never comes; one round
    # trip to etcd took 1.9 s once with two suites sharing 2 cores.
    assert time.monotonic() - started < 10.0


def test_watch_resumes_from_a_revision_without_loss_or_repetition(store: Store) -> None:
    start = store.get_prefix("")[1]
    for i in range(10):
        store.set(f"q/{i}", str(i).encode())
    seen: list[str] = []
    revision = start
    first = store.watch("q/", revision, 1.0)
    # Resume from the middle of what the first call returned.
    middle = first.events[4].revision
    seen = [e.key for e in first.events[:5]]
    for i in range(10, 13):
        store.set(f"q/{i}", str(i).encode())
    while True:
        result = store.watch("q/", middle, 0.2)
        if not result.events:
            break
        seen.extend(e.key for e in result.events)
        middle = result.revision
    assert seen == [f"q/{i}" for i in range(13)]


def test_watch_blocks_until_another_client_writes(kit: StoreKit) -> None:
    watcher, writer = kit.client(), kit.client()
    revision = writer.set("x", b"0")
    thread = in_thread(lambda: writer.set("room/door", b"open"), 0.2)
    started = time.monotonic()
    result = watcher.watch("room/", revision, 5.0)
    thread.join()
    assert kinds(result.events) == [(EventKind.PUT, "room/door", b"open")]
    assert time.monotonic() - started < 3.0


def test_a_write_outside_the_prefix_does_not_end_a_watch(kit: StoreKit) -> None:
    watcher, writer = kit.client(), kit.client()
    revision = writer.set("x", b"0")
    thread = in_thread(lambda: writer.set("elsewhere", b"1"), 0.05)
    result = watcher.watch("room/", revision, 0.4)
    thread.join()
    assert result.events == ()


def test_a_blocked_watch_does_not_hold_up_other_calls_of_the_same_client(store: Store) -> None:
    revision = store.set("x", b"0")
    results = []
    thread = threading.Thread(target=lambda: results.append(store.watch("late/", revision, 5)))
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    for i in range(20):
        store.set(f"busy/{i}", b"1")
        assert store.get(f"busy/{i}") == b"1"
    assert time.monotonic() - started < 3.0
    store.set("late/k", b"1")
    thread.join()
    assert kinds(results[0].events) == [(EventKind.PUT, "late/k", b"1")]


def test_watch_on_pruned_history_raises_compacted(make_kit: MakeKit) -> None:
    store = make_kit(history=8).client()
    first = store.set("k", b"0")
    for i in range(20):
        store.set("k", str(i).encode())
    with pytest.raises(StoreCompactedError):
        store.watch("k", first, 1.0)
    # Recent history is still there: re-read, then resume.
    _, revision = store.get_prefix("")
    store.set("k", b"fresh")
    assert kinds(store.watch("k", revision, 1.0).events) == [(EventKind.PUT, "k", b"fresh")]


# -- wait --------------------------------------------------------------------------------


def test_wait_returns_at_once_when_every_key_exists(store: Store) -> None:
    store.set("a", b"1")
    store.set("b", b"2")
    store.wait(["a", "b"], 0)
    store.wait([], 0)


def test_wait_blocks_until_every_key_is_written(kit: StoreKit) -> None:
    waiter, writer = kit.client(), kit.client()
    writer.set("a", b"1")
    thread = in_thread(lambda: writer.set("b", b"2"), 0.2)
    started = time.monotonic()
    waiter.wait(["a", "b"], 5.0)
    thread.join()
    assert 0.15 <= time.monotonic() - started < 3.0


def test_wait_times_out_naming_the_missing_keys(store: Store) -> None:
    store.set("a", b"1")
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="missing-key"):
        store.wait(["a", "missing-key"], 0.3)
    assert time.monotonic() - started >= 0.25


def test_close_is_idempotent(kit: StoreKit) -> None:
    client = kit.client()
    client.set("k", b"v")
    client.close()
    client.close()


# -- cancellation -----------------------------------------------------------------------


def _cancel_soon(scope: CancelScope, after: float = 0.2) -> threading.Timer:
    timer = threading.Timer(after, scope.cancel, args=("stop asked",))
    timer.start()
    return timer


def test_cancelling_a_scope_ends_a_blocked_watch_at_once_with_cancelled(store: Store) -> None:
    _, rev = store.get_prefix("c/")
    scope = CancelScope()
    timer = _cancel_soon(scope)
    t0 = time.monotonic()
    with pytest.raises(Cancelled, match="stop asked"):
        store.watch("c/", rev, 30.0, scope=scope)
    took = time.monotonic() - t0
    timer.join()
    assert 0.15 <= took < 0.2 + 0.5, took
    # The client goes on working: the next watch sees the next change.
    store.set("c/after", b"1")
    result = store.watch("c/", rev, 5.0)
    assert [e.key for e in result.events] == ["c/after"]


def test_cancelling_a_scope_ends_a_blocked_wait_at_once_with_cancelled(store: Store) -> None:
    scope = CancelScope()
    timer = _cancel_soon(scope)
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        store.wait(["c/never"], 30.0, scope=scope)
    timer.join()
    assert time.monotonic() - t0 < 0.2 + 0.5
    store.set("c/now", b"1")
    store.wait(["c/now"], 5.0)


def test_a_scope_cancelled_before_the_call_ends_it_without_waiting(store: Store) -> None:
    scope = CancelScope()
    scope.cancel("too late")
    _, rev = store.get_prefix("c/")
    t0 = time.monotonic()
    with pytest.raises(Cancelled, match="too late"):
        store.watch("c/", rev, 30.0, scope=scope)
    with pytest.raises(Cancelled):
        store.wait(["c/never"], 30.0, scope=scope)
    assert time.monotonic() - t0 < 0.5


def test_cancelling_a_parent_scope_ends_a_watch_in_its_child(store: Store) -> None:
    _, rev = store.get_prefix("c/")
    parent = CancelScope()
    with parent.child(timeout=60.0) as child:
        timer = _cancel_soon(parent)
        with pytest.raises(Cancelled):
            store.watch("c/", rev, 30.0, scope=child)
        timer.join()


def test_a_watch_in_an_uncancelled_scope_returns_its_changes(kit: StoreKit) -> None:
    writer, watcher = kit.client(), kit.client()
    _, rev = watcher.get_prefix("c/")
    with CancelScope() as scope:
        timer = threading.Timer(0.1, writer.set, args=("c/x", b"1"))
        timer.start()
        result = watcher.watch("c/", rev, 10.0, scope=scope)
        timer.join()  # the write's answer may come after the watch saw it
    assert [e.key for e in result.events] == ["c/x"]
