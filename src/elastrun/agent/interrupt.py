"""Blocking calls that a signal ends at once.

The rendezvous' waits (a store watch, a connection attempt, the exit barrier) and the
job-wide budget's store call can block for a long time inside code that takes no
cancellation scope. The agent runs such a call in a helper thread and itself waits on
the shutdown waker, so a signal is answered within milliseconds whatever the call is
blocked in; the abandoned call ends with the process or when the handler shuts down.
"""

from __future__ import annotations

import selectors
import threading
from collections.abc import Callable
from typing import TypeVar

from elastrun.core.cancel import Cancelled
from elastrun.core.shutdown import ShutdownRequest

T = TypeVar("T")


def call_interruptibly(
    call: Callable[[], T], shutdown: ShutdownRequest, on_signal: Callable[[], None], what: str
) -> T:
    """Return ``call()``'s value (or raise its exception), unless a signal arrives first:
    then ``on_signal()`` runs, which is expected to raise (``ShutdownRequested``).

    Other wake-ups of the waker (rendezvous news) are drained here; the agent's loop
    looks at what changed on its next pass anyway.
    """
    box: list[tuple[bool, object]] = []
    done = threading.Event()
    waker = shutdown.waker

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # handed to the waiting thread below
            box.append((False, exc))
        finally:
            done.set()
            waker.wake()

    threading.Thread(target=run, name=f"elastrun-agent-{what}", daemon=True).start()
    with selectors.DefaultSelector() as sel:
        sel.register(waker.fileno(), selectors.EVENT_READ)
        while not done.is_set():
            if shutdown.signum is not None:
                on_signal()
            sel.select()
            waker.drain()
    ok, value = box[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]  # what ``call`` returned, a T


def run_interruptibly(
    call: Callable[[], T],
    shutdown: ShutdownRequest,
    on_signal: Callable[[], None],
    what: str,
    *,
    observes_cancel_scope: bool,
) -> T:
    """``call()``, ended by a signal: a call that observes cancel scopes runs in the
    shutdown request's scope (a signal cancels every store wait inside it); any other
    runs in a helper thread (``call_interruptibly``). ``on_signal`` is expected to raise.
    """
    if not observes_cancel_scope:
        return call_interruptibly(call, shutdown, on_signal, what)
    try:
        with shutdown.scope.active():
            return call()
    except Cancelled:
        on_signal()  # raises ShutdownRequested
        raise
