"""A shutdown request: what signal handlers record, and how they wake the agent."""

from __future__ import annotations

import signal
import threading

from elastrun.core.cancel import CancelScope, SignalRelay
from elastrun.core.waker import Waker


class ShutdownRequest:
    """Set by signal handlers (or any thread); read by the agent at safe points.

    The first signal is remembered; each further one increments ``count`` so the agent
    can escalate (a second Ctrl-C skips the grace period).

    ``scope`` is cancelled by the first request, so every wait handed that scope (the
    rendezvous, the exit barrier, the store calls of the restart budget) ends at once.
    From a signal handler the cancellation goes through a relay thread (see
    ``SignalRelay``), running between ``start_relay()`` and ``close()``.
    """

    def __init__(self, waker: Waker | None = None) -> None:
        self.waker = waker if waker is not None else Waker()
        self.scope = CancelScope()
        self._signum: int | None = None
        self._count = 0
        self._lock = threading.Lock()
        self._relay: SignalRelay | None = None

    def request(self, signum: int) -> None:
        # Called from a signal handler: only record and wake, never raise.
        if self._signum is None:
            self._signum = signum
        self._count += 1
        self.waker.wake()
        relay = self._relay
        if relay is not None:
            relay.wake()

    def start_relay(self) -> None:
        """Start cancelling ``scope`` on requests (idempotent)."""
        with self._lock:
            if self._relay is None:
                self._relay = SignalRelay(self.scope, self._reason)
        if self._signum is not None:
            self.scope.cancel(self._reason() or "stopped")

    def stop_relay(self) -> None:
        with self._lock:
            relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()

    def _reason(self) -> str | None:
        signum = self._signum
        if signum is None:
            return None
        try:
            return f"received {signal.Signals(signum).name}"
        except ValueError:
            return f"received signal {signum}"

    @property
    def signum(self) -> int | None:
        return self._signum

    @property
    def count(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._signum is not None

    def __repr__(self) -> str:
        return f"ShutdownRequest(signum={self._signum}, count={self._count})"
