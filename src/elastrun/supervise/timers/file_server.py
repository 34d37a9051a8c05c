"""The agent's watchdog over the file timers: read requests from a FIFO, reap on expiry.

Workers' :class:`~elastrun.timer.FileTimerClient` write one JSON line per request
(:mod:`elastrun.timer.file`, :mod:`elastrun.wire.timer`); :class:`FileTimerServer` reads
them on a thread and signals a worker whose timer runs out.

Unlike torch's server, ours signals only the worker (and its process group when the
worker leads one) -- never its own process. torch's also sends the signal to
``os.getpid()``, which is the agent: an expired timer then SIGKILLs the agent, no
restart happens and the other workers are orphaned. Here the agent learns which worker
was reaped (``on_expired``), sees it exit, and treats it as any worker failure.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import shutil
import signal as _signal
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import cast

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError
from elastrun.core.threads import Nursery
from elastrun.core.timers import TimerTable
from elastrun.supervise.processes.dstate import read_proc_state
from elastrun.wire.timer import FileTimerRequest, TimerRequestError

__all__ = ["FileTimerServer", "LogEvent", "OnExpired", "ReapDecision", "plan_reaps"]

log = logging.getLogger(__name__)

_MAX_PENDING_BYTES = 1 << 20  # a writer that never sends a newline cannot grow us forever

OnExpired = Callable[[int, str, int], None]
LogEvent = Callable[[str, "FileTimerRequest | None"], None]


@dataclass(frozen=True)
class ReapDecision:
    """What to do about one worker whose timers ran out.

    ``request`` is the earliest expired timer that carries a signal; None when none
    does, in which case the worker is reported but not signalled.
    """

    pid: int
    expired: tuple[FileTimerRequest, ...]
    request: FileTimerRequest | None

    @property
    def signal(self) -> int:
        return self.request.signal if self.request is not None else 0

    @property
    def scope_id(self) -> str:
        return (self.request or self.expired[0]).scope_id


def plan_reaps(expired: Mapping[int, Sequence[FileTimerRequest]]) -> list[ReapDecision]:
    """Decide, per worker, which expired timer is acted on and with which signal.

    For each pid (in pid order) the expired timers are taken in expiration order and
    the first one with a positive signal is chosen, as torch does.
    """
    decisions = []
    for pid in sorted(expired):
        ordered = tuple(sorted(expired[pid], key=lambda r: r.expiration_time))
        if not ordered:
            continue
        chosen = next((r for r in ordered if r.signal > 0), None)
        decisions.append(ReapDecision(pid, ordered, chosen))
    return decisions


def _refusal(pid: int, sig: int) -> str | None:
    """Why ``pid`` must not be sent ``sig``, or None when it may."""
    if pid <= 0:
        return "not a process id"  # 0 and -1 would reach a whole group, or everything
    if pid == os.getpid():
        return "it is the timer server's own process"
    if not 0 < sig < _signal.NSIG:
        return f"{sig} is not a signal number"
    return None


class FileTimerServer:
    """Reads timer requests from a FIFO and signals workers whose timers run out.

    Args:
        file_path: where to create the FIFO (an existing file there is replaced). None
            creates it in a fresh private directory; see :attr:`file_path`.
        run_id: the job's run id, for logs.
        max_interval: the longest the watchdog sleeps between two passes, in seconds.
            A timer is acted on when it runs out, not at the next interval; the interval
            bounds how late dead workers' timers are dropped and the progress time.
        daemon: run the watchdog on a daemon thread.
        log_event: ``(name, request)`` for "watchdog started", "watchdog stopped",
            "timer expired" and "kill worker process".
        on_expired: ``(pid, scope_id, signal)``, called just *before* a worker is
            signalled, so that whoever is waiting for that worker to exit already knows
            why when it does. Runs on the watchdog thread; must not block.
        clock: the source of "now" (wall clock) for expiration times.

    Raises:
        ConfigError: ``max_interval`` is not positive.
    """

    def __init__(
        self,
        file_path: str | None,
        run_id: str,
        max_interval: float = 10,
        daemon: bool = True,
        log_event: LogEvent | None = None,
        *,
        on_expired: OnExpired | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not max_interval > 0:
            raise ConfigError("max_interval", max_interval, "must be a positive number of seconds")
        # Unlike torch, the FIFO is made in start(), not here: constructors do no I/O.
        # Clients cannot tell the difference, since a FIFO nobody reads refuses them.
        self._requested_path = file_path
        self._private_dir: str | None = None  # made at start() when no path was given
        self._run_id = run_id
        self._max_interval = max_interval
        self._daemon = daemon
        self._log_event = log_event
        self._on_expired = on_expired
        self._clock = clock
        self._timers: TimerTable[FileTimerRequest] = TimerTable()
        self._lock = threading.Lock()  # guards _timers against readers on other threads
        self._nursery: Nursery | None = None  # a fresh one per start(); stop() closes it
        self._rfd = -1
        self._wfd = -1  # our own writer: the FIFO never reads EOF (poll would spin on POLLHUP)
        self._pending = b""
        self._request_count = 0  # torch's tests read this name
        self._client_seen = False
        self._last_progress_time = int(clock.time())

    @property
    def file_path(self) -> str | None:
        """The FIFO path (None before :meth:`start` when no path was given)."""
        if self._private_dir is not None:
            return os.path.join(self._private_dir, "watchdog_timer")
        return self._requested_path

    @property
    def request_count(self) -> int:
        """How many requests were received since start."""
        return self._request_count

    def active_timers(self) -> dict[int, list[str]]:
        """A snapshot of the armed timers: pid -> scope ids."""
        with self._lock:
            out: dict[int, list[str]] = {}
            for request in self._timers:
                out.setdefault(request.worker_pid, []).append(request.scope_id)
            return out

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Create the FIFO, open it and start the watchdog thread.

        Raises:
            OSError: the FIFO could not be created or opened.
        """
        if self._nursery is not None:
            return
        if self._requested_path is None:
            # A fresh private directory: nobody else can pre-create, replace or write it.
            self._private_dir = tempfile.mkdtemp(prefix="elastrun-timer-")
        else:
            with suppress(FileNotFoundError):  # (nothing to replace)
                os.unlink(self._requested_path)
        path = cast(str, self.file_path)
        try:
            os.mkfifo(path, 0o600)
            flags = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
            self._rfd = os.open(path, os.O_RDONLY | flags)
            if not stat.S_ISFIFO(os.fstat(self._rfd).st_mode):
                raise OSError(errno.EINVAL, "not a FIFO", path)
            self._wfd = os.open(path, os.O_WRONLY | flags)
        except OSError:
            self._close_and_remove()
            raise
        self._pending = b""
        log.info("starting %r", self)
        self._nursery = Nursery(join_timeout=max(self._max_interval, 1.0))
        self._nursery.start(
            self._watchdog_loop, name="FileTimerServer-watchdog", daemon=self._daemon
        )
        self._emit("watchdog started", None)

    def stop(self) -> None:
        """Stop the watchdog (promptly: it is woken, not waited for) and remove the FIFO.

        Idempotent; never raises for cleanup problems (they are logged).
        """
        nursery, self._nursery = self._nursery, None
        if nursery is not None and nursery.close("stopped"):
            # Closing descriptors under a live thread could make it read a reused fd.
            log.error("timer watchdog thread did not stop; leaving its FIFO open")
            return
        self._close_and_remove()
        if nursery is not None:
            self._emit("watchdog stopped", None)

    def run_once(self) -> None:
        """Process what is already in the FIFO, then stop (a helper for tests, as torch's)."""
        self.stop()

    def _close_and_remove(self) -> None:
        for fd in (self._rfd, self._wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:
                    log.warning("closing the timer FIFO: %s", exc)
        self._rfd = self._wfd = -1
        path = self.file_path
        if path is not None:
            try:
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass  # already removed by someone else; that is what we wanted
            except OSError as exc:
                log.warning("removing the timer FIFO %s: %s", path, exc)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    # -- the watchdog ----------------------------------------------------------------

    def _watchdog_loop(self, scope: CancelScope) -> None:
        poller = select.poll()
        poller.register(self._rfd, select.POLLIN)
        # Woken by stop() through the scope, the pass still reads what the FIFO holds.
        poller.register(scope.fileno(), select.POLLIN)
        while not scope.cancelled:
            try:
                self._run_watchdog(poller)
            except Exception:
                log.exception("timer watchdog pass failed")
                scope.sleep(self._max_interval)

    def _run_watchdog(self, poller: select.poll) -> None:
        # Wait for requests until the next timer runs out, at most max_interval; a timer
        # already past (a reap to retry) waits the full interval: no spin.
        with self._lock:
            nxt = self._timers.next_expiration()
        left = self._max_interval if nxt is None else nxt - self._clock.time()
        timeout = min(self._max_interval, left) if left > 0 else self._max_interval
        if poller.poll(max(0, int(timeout * 1000) + 1)):
            self.register_timers(self._read_requests())
        # Drop the timers of exited workers first: an exited worker is not to be reported
        # as timed out, and its pid may already belong to some other process.
        self.clear_timers(set())
        reaped = self._reap_expired(self._clock.time())
        self.clear_timers(reaped)
        self._last_progress_time = int(self._clock.time())

    def _read_requests(self) -> list[FileTimerRequest]:
        chunks = [self._pending]
        while True:
            try:
                data = os.read(self._rfd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            chunks.append(data)
        *lines, self._pending = b"".join(chunks).split(b"\n")
        if len(self._pending) > _MAX_PENDING_BYTES:
            log.warning("dropping %d bytes of an unterminated timer request", len(self._pending))
            self._pending = b""
        requests = []
        for line in lines:
            if not line.strip():
                continue
            try:
                requests.append(FileTimerRequest.from_json(line))
            except TimerRequestError as exc:
                log.warning("ignoring a malformed timer request: %s", exc)
        if requests:
            self._client_seen = True
        return requests

    def _reap_expired(self, now: float) -> set[int]:
        expired = self.get_expired_timers(now)
        if not expired:
            return set()
        log.info(
            "run %s: expired timers %s",
            self._run_id,
            {pid: [r.to_json() for r in timers] for pid, timers in expired.items()},
        )
        done: set[int] = set()
        for decision in plan_reaps(expired):
            self._emit("timer expired", decision.request or decision.expired[0])
            if decision.request is None:
                log.info(
                    "worker pid %s: no expired timer asks for a signal; not reaped", decision.pid
                )
                done.add(decision.pid)
                continue
            refusal = _refusal(decision.pid, decision.signal)
            if refusal is not None:
                log.error("not signalling pid %s: %s", decision.pid, refusal)
                done.add(decision.pid)
                continue
            if self._on_expired is not None:
                try:
                    self._on_expired(decision.pid, decision.scope_id, decision.signal)
                except Exception:
                    log.exception("on_expired callback failed for pid %s", decision.pid)
            if self._reap_worker(decision.pid, decision.signal):
                log.info(
                    "reaped worker pid %s (timer %r) with signal %s",
                    decision.pid,
                    decision.scope_id,
                    decision.signal,
                )
                self._emit("kill worker process", decision.request)
                done.add(decision.pid)
            else:
                log.error("could not reap worker pid %s; retrying", decision.pid)
        return done

    def _emit(self, name: str, request: FileTimerRequest | None) -> None:
        if self._log_event is None:
            return
        try:
            self._log_event(name, request)
        except Exception:
            log.exception("log_event callback failed for %r", name)

    # -- torch-compatible operations ---------------------------------------------------

    def register_timers(self, timer_requests: list[FileTimerRequest]) -> None:
        """Apply acquires and releases (negative expiration time)."""
        with self._lock:
            self._request_count += self._timers.register(timer_requests)

    def clear_timers(self, worker_pids: set[int]) -> None:
        """Drop the timers of ``worker_pids`` and of every pid that is no longer running."""
        with self._lock:
            self._timers.clear_if(
                lambda p: p in worker_pids or not self.is_process_running(cast(int, p))
            )

    def get_expired_timers(self, deadline: float) -> dict[int, list[FileTimerRequest]]:
        """The timers with ``expiration_time <= deadline``, grouped by pid."""
        with self._lock:
            return {cast(int, pid): reqs for pid, reqs in self._timers.expired(deadline).items()}

    @staticmethod
    def is_process_running(pid: int) -> bool:
        """True when ``pid`` exists, has not exited (a zombie has) and we may signal it."""
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        # No procfs (or it just vanished; None): kill(pid, 0) has the last word.
        return read_proc_state(pid) != "Z"

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        """Send ``signal`` to the worker (to its group when it leads one); True when done.

        Never signals the server's own process. A worker that is already gone counts as
        reaped; a refused signal (EPERM) does not, and is retried.
        """
        refusal = _refusal(worker_pid, signal)
        if refusal is not None:
            log.error("not signalling pid %s: %s", worker_pid, refusal)
            return True
        try:
            pgid = os.getpgid(worker_pid)
            # A worker leading its own group (elastrun starts them so) takes its children
            # with it; a pid in our group or someone else's is signalled alone.
            if pgid == worker_pid and pgid != os.getpgrp():
                os.killpg(pgid, signal)
            else:
                os.kill(worker_pid, signal)
        except ProcessLookupError:
            log.info("worker pid %s is already gone", worker_pid)
        except OSError:
            log.exception("could not signal worker pid %s", worker_pid)
            return False
        return True

    def get_last_progress_time(self) -> int:
        """Wall-clock second of the watchdog's last pass; now, if no client wrote yet."""
        return self._last_progress_time if self._client_seen else int(self._clock.time())

    def __repr__(self) -> str:
        running = self._nursery is not None and bool(self._nursery.running())
        return (
            f"FileTimerServer(file_path={self.file_path!r}, run_id={self._run_id!r}, "
            f"max_interval={self._max_interval}, running={running}, timers={len(self._timers)})"
        )
