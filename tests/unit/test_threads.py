"""core.threads: named daemon threads by default, and a join that is bounded and safe."""

from __future__ import annotations

import threading

from elastrun.core.threads import join_thread, new_thread, start_thread


def test_a_started_thread_is_named_a_daemon_by_default_and_gets_its_arguments() -> None:
    got: list[tuple[object, ...]] = []
    thread = start_thread(lambda *args: got.append(args), 1, "two", name="elastrun-test")
    assert join_thread(thread, 5.0)
    assert (thread.name, thread.daemon, got) == ("elastrun-test", True, [(1, "two")])


def test_the_owner_may_ask_for_a_thread_that_keeps_the_process_alive() -> None:
    thread = start_thread(lambda: None, name="elastrun-test", daemon=False)
    assert join_thread(thread, 5.0)
    assert not thread.daemon


def test_a_new_thread_is_not_started_until_its_owner_starts_it() -> None:
    ran = threading.Event()
    thread = new_thread(ran.set, name="elastrun-test")
    assert (thread.ident, thread.name, thread.daemon) == (None, "elastrun-test", True)
    assert join_thread(thread, 5.0)  # nothing to wait for, and no RuntimeError
    assert not ran.is_set()
    thread.start()
    assert join_thread(thread, 5.0) and ran.is_set()


def test_joining_a_thread_that_does_not_end_gives_up_at_the_bound_and_says_so() -> None:
    release = threading.Event()
    thread = start_thread(release.wait, name="elastrun-test")
    try:
        assert not join_thread(thread, 0.01)
        assert thread.is_alive()
    finally:
        release.set()
    assert join_thread(thread, None)


def test_there_is_nothing_to_wait_for_without_a_thread_or_from_the_thread_itself() -> None:
    assert join_thread(None, 0.0)
    answers: list[bool] = []
    thread = new_thread(lambda: answers.append(join_thread(thread, None)), name="elastrun-test")
    thread.start()
    assert join_thread(thread, 5.0)
    assert answers == [True]
