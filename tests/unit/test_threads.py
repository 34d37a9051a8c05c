"""core.threads: nurseries that start named daemon threads by default, stop and join
them, and hand a call's result to its waiter; a join that is bounded and safe."""

from __future__ import annotations

import threading

import pytest

from elastrun.core.cancel import Cancelled, CancelScope, current
from elastrun.core.threads import Nursery, join_thread


def test_a_nursery_thread_is_named_a_daemon_by_default_and_gets_its_arguments() -> None:
    got: list[tuple[object, ...]] = []
    with Nursery() as nursery:
        thread = nursery.start(lambda scope, *args: got.append(args), 1, "two", name="elastrun-t")
        assert join_thread(thread, 5.0)
    assert (thread.name, thread.daemon, got) == ("elastrun-t", True, [(1, "two")])


def test_the_owner_may_ask_for_a_thread_that_keeps_the_process_alive() -> None:
    with Nursery() as nursery:
        thread = nursery.start(lambda scope: None, name="elastrun-test", daemon=False)
    assert not thread.is_alive() and not thread.daemon


def test_joining_a_thread_that_does_not_end_gives_up_at_the_bound_and_says_so() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="elastrun-test", daemon=True)
    thread.start()
    try:
        assert not join_thread(thread, 0.01)
        assert thread.is_alive()
    finally:
        release.set()
    assert join_thread(thread, None)


def test_there_is_nothing_to_wait_for_without_a_thread_or_from_the_thread_itself() -> None:
    assert join_thread(None, 0.0)
    answers: list[bool] = []
    thread = threading.Thread(target=lambda: answers.append(join_thread(thread, None)))
    assert join_thread(thread, 5.0)  # never started: nothing to wait for, no RuntimeError
    thread.start()
    assert join_thread(thread, 5.0)
    assert answers == [True]


def test_a_nursery_runs_each_target_in_its_scope_and_close_stops_and_joins_them() -> None:
    seen: list[tuple[str, bool]] = []

    def tick(scope: CancelScope, label: str) -> None:
        seen.append((label, current() is scope))
        while True:
            scope.sleep(30)  # (raises Cancelled at close: the thread's normal end)

    nursery = Nursery(join_timeout=5)
    threads = [nursery.start(tick, str(i), name=f"elastrun-test-{i}") for i in range(3)]
    assert [t.name for t in threads] == ["elastrun-test-0", "elastrun-test-1", "elastrun-test-2"]
    assert all(t.daemon for t in threads)
    assert nursery.close("owner closed") == []
    assert not any(t.is_alive() for t in threads)
    assert sorted(seen) == [("0", True), ("1", True), ("2", True)]
    assert nursery.scope.reason == "owner closed"
    assert nursery.close() == []  # idempotent


def test_a_closed_nursery_starts_nothing_and_a_parents_cancel_stops_its_threads() -> None:
    parent = CancelScope()
    nursery = Nursery(parent)
    thread = nursery.start(lambda scope: scope.sleep(30), name="elastrun-test")
    parent.cancel("the owner's owner stopped")
    thread.join(5)
    assert not thread.is_alive()
    assert nursery.running() == []
    nursery.close()
    with pytest.raises(RuntimeError, match="nursery is closed"):
        nursery.start(lambda scope: None, name="elastrun-test-late")


def test_close_gives_up_at_its_bound_on_a_thread_that_ignores_its_scope_and_names_it() -> None:
    release = threading.Event()
    nursery = Nursery(join_timeout=0.05)
    nursery.start(lambda scope: release.wait(), name="elastrun-test-deaf")
    try:
        assert nursery.close() == ["elastrun-test-deaf"]
    finally:
        release.set()
    assert nursery.close(timeout=5) == []


def test_a_thread_may_close_its_own_nursery_and_its_siblings_end() -> None:
    nursery = Nursery()
    sibling = nursery.start(lambda scope: scope.sleep(30), name="elastrun-test-sibling")
    left: list[list[str]] = []

    def closer(scope: CancelScope) -> None:
        left.append(nursery.close("done"))

    closing = nursery.start(closer, name="elastrun-test-closer")
    closing.join(5)
    assert left == [[]] and not sibling.is_alive()


def test_a_call_hands_its_value_or_its_exception_to_the_thread_that_waits() -> None:
    nursery = Nursery(join_timeout=5)
    call = nursery.call(lambda scope, x: (x, current() is scope), 7, name="elastrun-test-call")
    assert call.wait(CancelScope()) and call.done
    assert call.result() == (7, True)  # (run in the nursery's scope, as start's targets)
    assert call.thread.name == "elastrun-test-call" and call.thread.daemon

    def fails(scope: CancelScope) -> None:
        raise KeyError("lost")

    failing = nursery.call(fails, name="elastrun-test-call")
    assert failing.wait(CancelScope())
    with pytest.raises(KeyError, match="lost"):
        failing.result()
    assert nursery.close() == []


def test_none_is_a_calls_value_and_no_result_is_given_before_its_end() -> None:
    release = threading.Event()
    nursery = Nursery(join_timeout=5)
    call = nursery.call(lambda scope: None if release.wait(30) else 0, name="elastrun-test")
    with pytest.raises(RuntimeError, match="has not ended"):
        call.result()
    release.set()
    assert call.wait(CancelScope()) and call.result() is None
    nursery.close()


def test_a_cancelled_or_expired_wait_leaves_the_call_running_in_its_nursery() -> None:
    release = threading.Event()
    nursery = Nursery(join_timeout=5)
    call = nursery.call(lambda scope: release.wait(30), name="elastrun-test-deaf")
    scope = CancelScope()
    threading.Timer(0.05, scope.cancel, ("received SIGTERM",)).start()
    with pytest.raises(Cancelled, match="SIGTERM"):
        call.wait(scope)
    with CancelScope().child(0.05) as short:
        assert not call.wait(short)  # its deadline: False, nothing raised
    assert not call.done and nursery.running() == ["elastrun-test-deaf"]
    release.set()
    assert call.wait(CancelScope()) and call.result() is True
    assert nursery.close() == []
