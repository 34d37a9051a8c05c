"""Expiration timers: the request, the client and server contracts, and ``expires``.

A worker wraps a block that must not hang in ``with expires(after=seconds):``. The block
acquires a countdown timer from a server (usually in the agent) on entry and releases
it on exit; if the timer runs out first, the server reaps the worker. The shapes here
follow ``torch.distributed.elastic.timer`` so that code written against torch's API runs
unchanged. The request and the table of armed timers (and why expiration times are
wall-clock seconds) are :mod:`elastrun.core.timers`', re-exported here under torch's names.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import sys
import time
from collections.abc import Hashable, Iterator

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.core.threads import Nursery
from elastrun.core.timers import TimerRequest, TimerTable, expired_timers

__all__ = [
    "RequestQueue",
    "TimerClient",
    "TimerNotConfiguredError",
    "TimerRequest",
    "TimerServer",
    "TimerTable",
    "configure",
    "expired_timers",
    "expires",
]

log = logging.getLogger(__name__)


class TimerNotConfiguredError(ElastrunError, RuntimeError):
    """``expires`` was used with no client passed and none set by :func:`configure`.

    Also a ``RuntimeError``, which is what torch raises in the same situation.
    """


class TimerClient(abc.ABC):
    """The worker's side: acquire and release timers with some server."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm the timer ``scope_id`` of this worker to run out at ``expiration_time``."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Disarm the timer ``scope_id`` of this worker."""


class RequestQueue(abc.ABC):
    """Where a server takes its clients' requests from."""

    @abc.abstractmethod
    def size(self) -> int:
        """How many requests are waiting now (it may grow before the next ``get``)."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Take up to ``size`` requests, waiting no more than ``timeout`` seconds in all."""


class TimerServer(abc.ABC):
    """Watches armed timers on a thread and reaps the workers whose timers run out.

    Args:
        request_queue: where the clients' requests arrive.
        max_interval: the longest the watchdog waits for requests between two checks
            of the timers, in seconds.
        daemon: run the watchdog on a daemon thread (it will not keep the process alive).
        clock: the source of "now" for comparing expiration times (wall clock).

    Raises:
        ConfigError: ``max_interval`` is not positive.
    """

    def __init__(
        self,
        request_queue: RequestQueue,
        max_interval: float,
        daemon: bool = True,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not max_interval > 0:
            raise ConfigError("max_interval", max_interval, "must be a positive number of seconds")
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._clock = clock
        self._nursery: Nursery | None = None  # a fresh one per start(): stop() closes it

    @property
    def _stop_signaled(self) -> bool:
        # torch's name for the stop flag; subclasses written against torch read it.
        return self._nursery is not None and self._nursery.scope.cancelled

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply acquires and releases (negative expiration time) to the armed timers."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Hashable]) -> None:
        """Drop every timer of the given workers."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Hashable, list[TimerRequest]]:
        """The timers with ``expiration_time <= deadline``, grouped by worker."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Hashable) -> bool:
        """Reap one worker; True when it is gone (or was never there).

        An exception raised here counts as "reaped", so that one bad worker id cannot
        wedge the watchdog on the same timer forever.
        """

    def _wakeup(self) -> None:  # noqa: B027  # reason: optional hook, no-op by default
        """Make a blocked ``get`` on the request queue return early (when ``stop`` cancels
        the watchdog's scope)."""

    def _reap_worker_no_throw(self, worker_id: Hashable) -> bool:
        try:
            return self._reap_worker(worker_id)
        except Exception:
            log.exception("reaping worker %r raised; counting it as reaped", worker_id)
            return True

    def _run_watchdog(self) -> None:
        """One watchdog round: take requests, register them, reap the expired workers."""
        batch_size = max(1, self._request_queue.size())
        self.register_timers(self._request_queue.get(batch_size, self._max_interval))
        reaped: set[Hashable] = set()
        for worker_id, timers in self.get_expired_timers(self._clock.time()).items():
            scopes = [t.scope_id for t in timers]
            log.info("reaping worker %r: expired timers %s", worker_id, scopes)
            if self._reap_worker_no_throw(worker_id):
                reaped.add(worker_id)
            else:
                log.error("could not reap worker %r; retrying at the next round", worker_id)
        self.clear_timers(reaped)

    def _watchdog_loop(self, scope: CancelScope) -> None:
        while not scope.cancelled:
            try:
                self._run_watchdog()
            except Exception:
                log.exception("timer watchdog round failed")
                # Back off so that a persistently failing queue does not spin the CPU.
                scope.sleep(self._max_interval)

    def start(self) -> None:
        """Start the watchdog thread."""
        if self._nursery is not None and not self._nursery.closed:
            return
        log.info("starting %r", self)
        self._nursery = Nursery(join_timeout=self._max_interval)
        self._nursery.scope.on_cancel(self._wakeup)
        self._nursery.start(
            self._watchdog_loop, name=f"{type(self).__name__}-watchdog", daemon=self._daemon
        )

    def stop(self) -> None:
        """Stop the watchdog thread and wait (up to ``max_interval``) for it to exit."""
        if self._nursery is None or self._nursery.closed:
            return
        if self._nursery.close("stopped"):
            log.warning(
                "%s watchdog thread did not exit within %ss",
                type(self).__name__,
                self._max_interval,
            )

    def __repr__(self) -> str:
        running = self._nursery is not None and bool(self._nursery.running())
        return (
            f"{type(self).__name__}(max_interval={self._max_interval}, daemon={self._daemon}, "
            f"running={running})"
        )


_timer_client: TimerClient | None = None


def configure(timer_client: TimerClient) -> None:
    """Set the client that :func:`expires` uses when it is given none."""
    global _timer_client
    _timer_client = timer_client
    log.info("timer client configured: %s", type(timer_client).__name__)


@contextlib.contextmanager
def _expiry(after: float, scope: str, client: TimerClient | None) -> Iterator[None]:
    """The context manager behind :func:`expires`."""
    # The configured client is looked up on entry, as torch does.
    client = client if client is not None else _timer_client
    if client is None:
        raise TimerNotConfiguredError(
            "no timer client: call elastrun.timer.configure(client) before expires()"
        )
    # Wall clock: the server, in another process, compares against its own time.time().
    client.acquire(scope, time.time() + after)
    try:
        yield
    finally:
        client.release(scope)


def expires(
    after: float, scope: str | None = None, client: TimerClient | None = None
) -> contextlib.AbstractContextManager[None]:
    """A countdown timer around a block: ``with expires(after=30): step()``.

    On entry the timer is acquired to run out ``after`` seconds from now; on exit (also
    by an exception) it is released. If it runs out first, the server may reap this
    worker -- not necessarily at that very instant, but from then on.

    Args:
        after: seconds until the timer runs out.
        scope: names the timer; by default ``"<caller file>#<line>"`` of the ``with``.
            (torch means the same default but computes it inside ``contextlib``, so
            its scopes all read ``.../contextlib.py#137``; ours name the caller.)
        client: the client to use; by default the one set by :func:`configure`.

    Raises:
        TimerNotConfiguredError: on entry, when no client was given or configured
            (a ``RuntimeError``).
    """
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    return _expiry(after, scope, client)
