"""A shutdown request: what signal handlers record, and how they wake the agent."""

from __future__ import annotations

import threading

from elastrun.core.waker import Waker


class ShutdownRequest:
    """Set by signal handlers (or any thread); read by the agent at safe points.

    The first signal is remembered; each further one increments ``count`` so the agent
    can escalate (a second Ctrl-C skips the grace period).
    """

    def __init__(self, waker: Waker | None = None) -> None:
        self.waker = waker if waker is not None else Waker()
        self._signum: int | None = None
        self._count = 0
        self._lock = threading.Lock()

    def request(self, signum: int) -> None:
        # Called from a signal handler: only record and wake, never raise.
        if self._signum is None:
            self._signum = signum
        self._count += 1
        self.waker.wake()

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
