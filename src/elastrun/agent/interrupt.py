"""Blocking calls that a signal ends at once.

The rendezvous' waits (a store watch, a connection attempt, the exit barrier) and the
job-wide budget's store call can block for a long time inside code that takes no
cancellation scope. The agent runs such a call in a helper thread and itself waits on
the shutdown waker, so a signal is answered within milliseconds whatever the call is
blocked in; the abandoned call ends with the process or when the handler shuts down.
"""

from __future__ import annotations

import logging
import selectors
import signal
import threading
from collections.abc import Callable
from typing import TypeVar

from elastrun.core.cancel import Cancelled
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest

log = logging.getLogger("elastrun.agent")

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


class Interruptible:
    """Runs blocking calls so that a signal ends them with ``ShutdownRequested``.

    The agent's loop answers that exception (it stops the workers with the signal); this
    object only ends the wait, so the rounds, the in-process steps and the restart
    budget's store calls use it without calling back into the loop.

    Args:
        shutdown: the request the launcher's signal handlers set.
        observes_cancel_scope: the calls cancel their store waits in the request's scope
            (else each runs in a helper thread, see ``call_interruptibly``).
    """

    def __init__(self, shutdown: ShutdownRequest, *, observes_cancel_scope: bool) -> None:
        self._shutdown = shutdown
        self._observes = observes_cancel_scope

    def __call__(self, call: Callable[[], T], what: str) -> T:
        """``call()``'s value, unless a signal comes first.

        Raises:
            ShutdownRequested: a signal was received before or during the call.
        """
        shutdown = self._shutdown

        def on_signal() -> None:
            log.info("stopped while waiting for the %s", what)
            signum = shutdown.signum
            raise ShutdownRequested(signum if signum is not None else signal.SIGTERM)

        return run_interruptibly(
            call, shutdown, on_signal, what, observes_cancel_scope=self._observes
        )

    def __repr__(self) -> str:
        return f"Interruptible(observes_cancel_scope={self._observes}, shutdown={self._shutdown!r})"
