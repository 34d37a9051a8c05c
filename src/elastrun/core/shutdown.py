"""A shutdown request: the root cancel scope of every wait of the agent.

The first request cancels ``scope``, which every blocking wait of the agent is handed
(or runs with as the thread's current scope): the rendezvous, the exit barrier, the
store calls of the restart budget, the wait for worker exits, the template's start-up
and spawn. So a stop request ends whatever the agent waits for at once, by the one
mechanism, with no separate wake-up pipe to poll. A further request also cancels
``grace``: the shutdown ladder's wait for the workers to stop takes that scope, so a
second Ctrl-C sends SIGKILL at once.

``request`` cancels, so it takes locks and runs callbacks: it must not be called from a
signal handler, which could interrupt a thread holding those locks. Signals reach it
through the launcher's relay thread (``launch.signals``).
"""

from __future__ import annotations

import signal
import threading

from elastrun.core.cancel import CancelScope


class ShutdownRequest:
    """A stop request (from a signal, or any thread) that the agent answers at a safe point.

    The first signal is remembered; each further one increments ``count``. ``scope`` is
    cancelled by the first request, ``grace`` by the second.
    """

    def __init__(self) -> None:
        self.scope = CancelScope()
        #: Cancelled by the second request: a stop under way skips the rest of its grace.
        self.grace = CancelScope()
        self._signum: int | None = None
        self._count = 0
        self._lock = threading.Lock()

    def request(self, signum: int) -> None:
        """Record a stop request for ``signum`` and cancel the scopes it ends.

        Thread-safe; not async-signal-safe (see the module docstring).
        """
        with self._lock:
            if self._signum is None:
                self._signum = signum
            self._count += 1
            first, count = self._signum, self._count
        try:
            reason = f"received {signal.Signals(first).name}"
        except ValueError:
            reason = f"received signal {first}"
        self.scope.cancel(reason)
        if count > 1:
            self.grace.cancel(f"{reason} again")

    @property
    def signum(self) -> int | None:
        return self._signum

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        """Release the scopes' descriptors (they stay usable as flags)."""
        self.scope.close()
        self.grace.close()

    def __bool__(self) -> bool:
        return self._signum is not None

    def __repr__(self) -> str:
        return f"ShutdownRequest(signum={self._signum}, count={self._count})"
