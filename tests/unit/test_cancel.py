"""Cancel scopes: the stop request, deadlines, nesting; the shutdown request's scopes."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastrun.core.cancel import Cancelled, CancelScope, scope_or_default
from elastrun.core.shutdown import ShutdownRequest
from elastrun.testing import FakeClock


def test_cancel_runs_every_callback_once_and_later_registrations_at_once() -> None:
    calls: list[str] = []
    scope = CancelScope()
    scope.on_cancel(lambda: calls.append("a"))
    forget = scope.on_cancel(lambda: calls.append("b"))
    forget()
    scope.cancel("why")
    scope.cancel("again")
    scope.on_cancel(lambda: calls.append("late"))
    assert calls == ["a", "late"]
    assert scope.cancelled and scope.reason == "why"
    with pytest.raises(Cancelled, match="why"):
        scope.raise_if_cancelled()


def test_a_failing_callback_does_not_keep_the_others_from_running() -> None:
    calls: list[str] = []
    scope = CancelScope()

    def broken() -> None:
        raise RuntimeError("boom")

    scope.on_cancel(broken)
    scope.on_cancel(lambda: calls.append("ok"))
    scope.cancel()
    assert calls == ["ok"]


def test_a_child_is_cancelled_with_its_parent_and_forgotten_when_closed() -> None:
    parent = CancelScope()
    with parent.child() as child:
        pass
    kept = parent.child()
    parent.cancel("parent stops")
    assert not child.cancelled  # closed before: detached
    assert kept.cancelled and kept.reason == "parent stops"
    kept.close()


def test_cancelling_a_child_leaves_the_parent_alone() -> None:
    parent = CancelScope()
    with parent.child() as child:
        child.cancel()
    assert not parent.cancelled


def test_a_child_deadline_is_never_later_than_its_parent() -> None:
    clock = FakeClock()
    parent = CancelScope(clock=clock).child(timeout=5.0)
    with parent.child(timeout=60.0) as child:
        assert child.remaining() == pytest.approx(5.0)
        assert child.remaining(2.0) == pytest.approx(2.0)
        clock.advance(7.0)
        assert child.remaining() == 0.0


def test_sleep_returns_after_its_time_and_raises_when_cancelled_meanwhile() -> None:
    scope = CancelScope()
    t0 = time.monotonic()
    scope.sleep(0.05)
    assert time.monotonic() - t0 >= 0.05
    threading.Timer(0.05, scope.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        scope.sleep(30.0)
    assert time.monotonic() - t0 < 1.0


def test_the_descriptor_becomes_readable_on_cancel_even_when_asked_for_late() -> None:
    r, w = os.pipe()
    try:
        scope = CancelScope()
        assert scope.wait_readable(r, 0.01) is False
        os.write(w, b"x")
        assert scope.wait_readable(r, 1.0) is True
        scope.cancel()
        with pytest.raises(Cancelled):
            scope.wait_readable(r, 30.0)
        late = CancelScope()
        late.cancel()
        with pytest.raises(Cancelled):
            late.wait_readable(r, 30.0)
        scope.close()
        late.close()
    finally:
        os.close(r)
        os.close(w)


def test_the_default_scope_cannot_be_cancelled() -> None:
    default = scope_or_default(None)
    with pytest.raises(RuntimeError):
        default.cancel()
    assert not default.cancelled
    given = CancelScope()
    assert scope_or_default(given) is given


def test_a_shutdown_request_cancels_its_scope_at_once_and_a_second_its_grace() -> None:
    request = ShutdownRequest()
    try:
        woke = threading.Event()
        request.scope.on_cancel(woke.set)
        threading.Thread(target=request.request, args=(15,)).start()
        assert woke.wait(2.0)
        assert request.scope.reason == "received SIGTERM"
        assert request.grace.reason is None  # one request: the stop keeps its grace
        request.request(2)
        assert request.grace.cancelled and request.count == 2
        assert request.signum == 15  # the first signal is the one answered
    finally:
        request.close()
