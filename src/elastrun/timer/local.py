"""Timers over a ``multiprocessing`` queue, for workers that are children of the server.

The parent creates a queue, hands it to :class:`LocalTimerServer` and to each child,
and each child builds a :class:`LocalTimerClient` on it. The worker id is the child's
pid; a worker whose timer runs out is SIGKILLed.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from collections.abc import Hashable
from typing import Protocol, cast

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.timer.api import RequestQueue, TimerClient, TimerRequest, TimerServer, TimerTable

__all__ = ["LocalTimerClient", "LocalTimerServer", "MPQueue", "MultiprocessingRequestQueue"]

log = logging.getLogger(__name__)


class MPQueue(Protocol):
    """What the local timers need of a ``multiprocessing.Queue``."""

    def put(self, obj: object, block: bool = ..., timeout: float | None = ...) -> None: ...

    def get(self, block: bool = ..., timeout: float | None = ...) -> object: ...

    def qsize(self) -> int: ...


class _Wakeup:
    """Put on the queue by the server itself so that a blocked ``get`` returns at stop."""


def _looks_like_request(item: object) -> bool:
    # Duck-typed so that requests from torch's own LocalTimerClient are accepted too.
    return all(hasattr(item, name) for name in ("worker_id", "scope_id", "expiration_time"))


class LocalTimerClient(TimerClient):
    """Client of :class:`LocalTimerServer`; identifies the worker by its pid.

    Args:
        mp_queue: the queue the server reads (inherited from the parent process).
    """

    def __init__(self, mp_queue: MPQueue) -> None:
        self._mp_queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, -1))

    def __repr__(self) -> str:
        return f"LocalTimerClient(pid={os.getpid()})"


class MultiprocessingRequestQueue(RequestQueue):
    """A :class:`RequestQueue` reading a ``multiprocessing.Queue``."""

    def __init__(self, mp_queue: MPQueue) -> None:
        self._mp_queue = mp_queue

    def size(self) -> int:
        try:
            return self._mp_queue.qsize()
        except NotImplementedError:  # macOS has no sem_getvalue; one at a time then
            return 1

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Take up to ``size`` requests within ``timeout`` seconds; a stop wake-up ends early."""
        requests: list[TimerRequest] = []
        deadline = time.monotonic() + max(0.0, timeout)
        while len(requests) < size:
            left = deadline - time.monotonic()
            try:
                item = self._mp_queue.get(block=left > 0, timeout=left if left > 0 else None)
            except queue.Empty:
                break
            if isinstance(item, _Wakeup):
                break
            if not _looks_like_request(item):
                log.warning("ignoring a non-timer item on the timer queue: %r", item)
                continue
            requests.append(cast(TimerRequest, item))
        return requests

    def wake(self) -> None:
        """Make a blocked :meth:`get` return."""
        try:
            self._mp_queue.put(_Wakeup(), block=False)
        except (ValueError, OSError, queue.Full) as exc:  # closed or full: get returns anyway
            log.debug("could not wake the timer queue reader: %s", exc)

    def __repr__(self) -> str:
        return "MultiprocessingRequestQueue()"


class LocalTimerServer(TimerServer):
    """Server of :class:`LocalTimerClient`: SIGKILLs workers whose timers run out.

    ``mp_queue`` is the queue the clients write; the other arguments, and the error for
    a ``max_interval`` that is not positive, are :class:`TimerServer`'s.
    """

    def __init__(
        self,
        mp_queue: MPQueue,
        max_interval: float = 60,
        daemon: bool = True,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._queue = MultiprocessingRequestQueue(mp_queue)
        super().__init__(self._queue, max_interval, daemon, clock=clock)
        self._timers: TimerTable[TimerRequest] = TimerTable()

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        self._timers.register(timer_requests)

    def clear_timers(self, worker_ids: set[Hashable]) -> None:
        self._timers.clear(worker_ids)

    def get_expired_timers(self, deadline: float) -> dict[Hashable, list[TimerRequest]]:
        return self._timers.expired(deadline)

    def _wakeup(self) -> None:
        self._queue.wake()

    def _reap_worker(self, worker_id: Hashable) -> bool:
        if not isinstance(worker_id, int) or worker_id <= 0 or worker_id == os.getpid():
            # pid 0 or -1 would signal our whole group or every process we may signal.
            log.error("refusing to reap worker id %r: not a worker pid", worker_id)
            return True
        try:
            os.kill(worker_id, signal.SIGKILL)
        except ProcessLookupError:
            log.info("worker pid %s is already gone", worker_id)
        except OSError:
            log.exception("could not SIGKILL worker pid %s", worker_id)
            return False
        return True

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, timers={len(self._timers)})"
