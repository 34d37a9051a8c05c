"""Expiration-timer requests and the table of armed timers.

Shared by both ends of every timer: the workers' clients (``elastrun.timer``) build
requests, the servers -- in a worker's own process (``LocalTimerServer``) or in the
agent (``elastrun.supervise.timers``) -- keep the armed ones in a :class:`TimerTable`.
It lives in the leaf layer so that neither end imports the other.

Expiration times are wall-clock seconds (``time.time()``): they cross process
boundaries, and the monotonic clock of one process means nothing in another.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["TimerRequest", "TimerTable", "expired_timers"]


class TimerRequest:
    """One acquire or release of a countdown timer, from a client to a server.

    Args:
        worker_id: identifies the worker to reap; its type is up to the client and
            server pair (the pid for the local and file timers).
        scope_id: names the timer within the worker; a worker can hold several.
        expiration_time: wall-clock second at which the timer runs out; a negative
            value means "release this scope".
    """

    __slots__ = ("expiration_time", "scope_id", "worker_id")

    def __init__(self, worker_id: Hashable, scope_id: str, expiration_time: float) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time

    @property
    def is_release(self) -> bool:
        """True when this request releases its scope instead of arming a timer."""
        return self.expiration_time < 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TimerRequest) and self._key() == other._key()

    def _key(self) -> tuple[object, ...]:
        return self.worker_id, self.scope_id, self.expiration_time

    # Mutable and compared by value, as torch's: not usable as a dict key.
    __hash__ = None  # type: ignore[assignment]  # reason: deliberately unhashable

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(worker_id={self.worker_id!r}, scope_id={self.scope_id!r}, "
            f"expiration_time={self.expiration_time!r})"
        )


R = TypeVar("R", bound=TimerRequest)


def expired_timers(timers: Iterable[R], deadline: float) -> dict[Hashable, list[R]]:
    """Group the timers that have run out by ``deadline`` by worker.

    A timer has run out when ``expiration_time <= deadline``. Release requests (negative
    expiration times) are never timers and are ignored. The result maps each worker id
    to its expired timers, in the order they were given.
    """
    out: dict[Hashable, list[R]] = {}
    for request in timers:
        if 0 <= request.expiration_time <= deadline:
            out.setdefault(request.worker_id, []).append(request)
    return out


class TimerTable(Generic[R]):
    """The armed timers of a server, keyed by ``(worker_id, scope_id)``.

    Pure bookkeeping with no clock and no I/O: the server decides what "now" is.
    Not thread-safe on its own; each server owns one and guards it.
    """

    def __init__(self) -> None:
        self._timers: dict[tuple[Hashable, str], R] = {}

    def register(self, requests: Iterable[R]) -> int:
        """Apply acquires (arm or re-arm) and releases (disarm); returns how many were seen."""
        count = 0
        for request in requests:
            count += 1
            key = (request.worker_id, request.scope_id)
            if request.is_release:
                self._timers.pop(key, None)
            else:
                self._timers[key] = request
        return count

    def clear(self, worker_ids: Collection[Hashable]) -> None:
        """Drop every timer of the given workers."""
        if not worker_ids:
            return
        for key in [k for k in self._timers if k[0] in worker_ids]:
            del self._timers[key]

    def clear_if(self, predicate: Callable[[Hashable], bool]) -> None:
        """Drop every timer whose worker id satisfies ``predicate`` (asked once per worker)."""
        self.clear({worker for worker in self.workers() if predicate(worker)})

    def expired(self, deadline: float) -> dict[Hashable, list[R]]:
        """The timers that have run out by ``deadline``, grouped by worker."""
        return expired_timers(self._timers.values(), deadline)

    def next_expiration(self) -> float | None:
        """The earliest expiration time of any armed timer, or None when there is none."""
        return min((r.expiration_time for r in self._timers.values()), default=None)

    def workers(self) -> set[Hashable]:
        """The workers that hold at least one timer."""
        return {worker for worker, _ in self._timers}

    def __len__(self) -> int:
        return len(self._timers)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._timers.values()))

    def __repr__(self) -> str:
        return f"TimerTable(timers={len(self._timers)}, workers={len(self.workers())})"
