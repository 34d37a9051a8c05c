"""Short full collections for a process that serves the store of a large job.

CPython's full collection scans every object that can hold references, and stops the
whole process meanwhile. The rendezvous store of 10,000 nodes holds some 350,000 of
them (connections, leases and their timers, the watch history): under the load of a
re-formation a full collection came every second or two there and stopped the server
0.1-0.35 s each time, during which no node was answered (the loss of a node was
noticed up to 0.35 s late, and its re-formation took 1.4-2.4 s instead of 1.3-1.7).

:func:`calm_full_collections` freezes (``gc.freeze``) what survived a full collection
that took longer than ``SLOW``: later collections then scan only what came after it.
A frozen object is never collected, so once every ``THAW_EVERY`` the frozen objects go
back to the collector, and the next full collection (one long one) sees them again:
garbage in reference cycles among them is kept that long at most. A small process (an
agent of a small job, a test) has no slow full collection and is left as it is. A
process forked from this one (a worker started by ``fork``) gets its collector back as
Python leaves it: the policy is this process's, not its children's.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Mapping

#: A full collection longer than this freezes what survived it (seconds).
SLOW = 0.05
#: How often the frozen objects go back to the collector (seconds).
THAW_EVERY = 600.0

_lock = threading.Lock()
_installed: list[Calm] = []


class Calm:
    """The ``gc.callbacks`` entry of :func:`calm_full_collections`."""

    def __init__(
        self,
        slow: float = SLOW,
        thaw_every: float = THAW_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slow = slow
        self._thaw_every = thaw_every
        self._clock = clock
        self._started: float | None = None
        self._thawed_at = clock()
        self.freezes = 0
        self.thaws = 0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if info.get("generation") != 2:
            return
        now = self._clock()
        if phase == "start":
            self._started = now
            return
        started, self._started = self._started, None
        if started is None:
            return
        if now - self._thawed_at >= self._thaw_every:
            self._thawed_at = now
            if gc.get_freeze_count():
                gc.unfreeze()  # the next full collection scans them once again
                self.thaws += 1
            return
        if now - started >= self._slow:
            gc.freeze()
            self.freezes += 1


def calm_full_collections() -> Calm:
    """Install the policy in this process, once; returns it."""
    with _lock:
        if not _installed:
            _installed.append(Calm())
            gc.callbacks.append(_installed[0])
            os.register_at_fork(after_in_child=_forget_in_child)
        return _installed[0]


def _forget_in_child() -> None:
    for calm in _installed:
        if calm in gc.callbacks:
            gc.callbacks.remove(calm)
    _installed.clear()
    gc.unfreeze()
