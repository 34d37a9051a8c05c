"""Cancel scopes: a deadline, a stop request and a wake-up, handed to every blocking wait.

A wait that takes a scope ends for one of three reasons: what it waits for happens, its
timeout (bounded by the scope's deadline) passes, or somebody cancels the scope -- then
it raises ``Cancelled`` at once, without polling a flag on a timer. Waits wire the
scope to their own wake-up: a callback (``on_cancel``) that sets their event or shuts
their socket down, or the scope's descriptor (``fileno``) in their ``select``.

Scopes nest: cancelling one cancels its children, and a child's deadline is never later
than its parent's. A scope can also be made *current* for a block (``with
scope.active():``): every store wait in that thread which is handed no scope of its own
observes the current one, so a caller cancels waits deep inside code (a rendezvous
handler) that never mentions scopes. Threads start with no current scope.

A deadline bounds every wait in the scope. The scope's own waits (``sleep``,
``wait_readable``) return at it as at their timeout. A store call (``store.api``) made in
a scope whose deadline passes before the call completes raises ``StoreTimeoutError``, not
``Cancelled``: nobody asked it to stop, it ran out of time, and the callers that bound a
store call (a keep-alive by its interval, closing a run by ``close_timeout``) handle it
with the store's other errors. Such a deadline is how a wait is bounded without a helper
thread: running the call in a throw-away thread and no longer waiting for it left the
call running, and each silent interval added another such thread.

``cancel`` is thread-safe but not async-signal-safe (it takes locks and runs
callbacks); signals reach it through the launcher's relay thread (``launch.signals``).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import math
import selectors
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.waker import Waker

log = logging.getLogger("elastrun.cancel")


class Cancelled(Exception):
    """A wait was ended because its scope was cancelled (not by a timeout)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CancelScope:
    """A stop request with an optional deadline that blocking waits observe.

    ``CancelScope()`` never expires by itself; ``scope.child(timeout)`` is cancelled
    with its parent and expires at its own deadline or the parent's, whichever is first.
    A child must be closed (or used as a context manager) so that its parent forgets it.
    """

    def __init__(
        self,
        *,
        deadline: Deadline | None = None,
        parent: CancelScope | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock: Clock = parent.clock if parent is not None else clock
        own = deadline if deadline is not None else Deadline.never(self._clock)
        self._deadline = own if parent is None else own.earliest(parent.deadline)
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._fired = threading.Event()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._waker: Waker | None = None
        self._unlink: Callable[[], None] | None = None
        if parent is not None:
            self._unlink = parent.on_cancel(lambda: self.cancel(parent.reason or "cancelled"))

    # -- the stop request ------------------------------------------------------------------

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask every wait in this scope (and its children) to end now; idempotent."""
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
            waker = self._waker
        self._fired.set()
        if waker is not None:
            waker.wake()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one broken wake-up must not keep the others asleep
                log.exception("a cancellation callback failed")

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    def raise_if_cancelled(self) -> None:
        if self._reason is not None:
            raise Cancelled(self._reason)

    # -- the deadline ------------------------------------------------------------------------

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def deadline(self) -> Deadline:
        return self._deadline

    def expired(self) -> bool:
        """Whether the deadline has passed (a scope without one never expires)."""
        return self._deadline.expired()

    def remaining(self, timeout: float = math.inf) -> float:
        """The time a wait of ``timeout`` may take in this scope (never negative)."""
        return min(max(0.0, timeout), self._deadline.remaining())

    # -- wake-ups ------------------------------------------------------------------------------

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` when the scope is cancelled (at once if it already is);
        returns a function that unregisters it."""
        with self._lock:
            if self._reason is None:
                key = next(self._ids)
                self._callbacks[key] = callback
                return lambda: self._forget(key)
        callback()
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)

    @contextmanager
    def wakes(self, callback: Callable[[], None]) -> Iterator[None]:
        """``callback`` runs if the scope is cancelled while the block runs."""
        unregister = self.on_cancel(callback)
        try:
            yield
        finally:
            unregister()

    def fileno(self) -> int:
        """A descriptor that becomes readable once the scope is cancelled (for
        ``select``); never drain it."""
        with self._lock:
            if self._waker is None:
                self._waker = Waker()
                if self._reason is not None:
                    self._waker.wake()
            return self._waker.fileno()

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (cut at the deadline); raises ``Cancelled`` when cancelled."""
        if self._fired.wait(self.remaining(seconds)):
            raise Cancelled(self._reason or "cancelled")

    def wait_readable(self, fd: int, timeout: float = math.inf) -> bool:
        """Wait until ``fd`` is readable (True) or the timeout passes (False); raises
        ``Cancelled`` when cancelled."""
        left = self.remaining(timeout)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ, "fd")
            sel.register(self.fileno(), selectors.EVENT_READ, "scope")
            ready = sel.select(None if math.isinf(left) else left)
        self.raise_if_cancelled()
        return bool(ready)

    # -- nesting ------------------------------------------------------------------------------

    @contextmanager
    def active(self) -> Iterator[CancelScope]:
        """Make this the current scope of the calling thread for the block."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def child(self, timeout: float | None = None) -> CancelScope:
        deadline = None if timeout is None else Deadline.after(timeout, self._clock)
        return CancelScope(deadline=deadline, parent=self)

    def close(self) -> None:
        """Detach from the parent and release the descriptor; the scope stays usable
        as a flag."""
        unlink, self._unlink = self._unlink, None
        if unlink is not None:
            unlink()
        with self._lock:
            waker, self._waker = self._waker, None
        if waker is not None:
            waker.close()

    def __enter__(self) -> CancelScope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"cancelled: {self._reason}" if self._reason is not None else "active"
        left = self._deadline.remaining()
        when = "" if math.isinf(left) else f", {left:.3f}s left"
        return f"CancelScope({state}{when})"


def current() -> CancelScope:
    """The calling thread's current scope (see ``CancelScope.active``), or one that is
    never cancelled."""
    scope = _CURRENT.get()
    return scope if scope is not None else _NEVER


def scope_or_default(scope: CancelScope | None) -> CancelScope:
    """The scope of a wait: the one passed, else the current one."""
    return scope if scope is not None else current()


def is_default(scope: CancelScope) -> bool:
    """Whether ``scope`` is the never-cancelled default (waits may skip wiring it)."""
    return scope is _NEVER


_CURRENT: contextvars.ContextVar[CancelScope | None] = contextvars.ContextVar(
    "elastrun_cancel_scope", default=None
)


# Shared by every wait without a scope: nobody may cancel it (``cancel`` is refused).
class _NeverCancelled(CancelScope):
    def cancel(self, reason: str = "cancelled") -> None:
        raise RuntimeError("the default scope cannot be cancelled")

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        return lambda: None

    def sleep(self, seconds: float) -> None:
        if seconds > 0 and not math.isinf(seconds):
            threading.Event().wait(seconds)


_NEVER = _NeverCancelled()
