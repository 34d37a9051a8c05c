"""Timers over a named pipe (FIFO), for workers that are not children of the server.

Each :class:`FileTimerClient` request is one JSON line written to the FIFO in a single
``write`` of at most ``PIPE_BUF`` bytes, which the kernel keeps whole even when many
workers write at once. :class:`FileTimerServer` reads the lines on a thread and signals
a worker whose timer runs out.

Unlike torch's server, ours signals only the worker (and its process group when the
worker leads one) -- never its own process. torch's also sends the signal to
``os.getpid()``, which is the agent: an expired timer then SIGKILLs the agent, no
restart happens and the other workers are orphaned. Here the agent learns which worker
was reaped (``on_expired``), sees it exit, and treats it as any worker failure.

:class:`AgentFileTimer` is the agent's handle on all this
(``TORCHELASTIC_ENABLE_FILE_TIMER`` / ``TORCHELASTIC_TIMER_FILE``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import signal as _signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.timer.api import TimerClient, TimerRequest, TimerTable

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "AgentFileTimer",
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "ReapDecision",
    "TimerRequestError",
    "file_timer_enabled",
    "plan_reaps",
]

log = logging.getLogger(__name__)

TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"

_OPEN_ATTEMPTS = 10
_OPEN_RETRY_INTERVAL = 0.1
_MAX_PENDING_BYTES = 1 << 20  # a writer that never sends a newline cannot grow us forever

OnExpired = Callable[[int, str, int], None]
LogEvent = Callable[[str, "FileTimerRequest | None"], None]


class TimerRequestError(ElastrunError, ValueError):
    """A line on the timer FIFO is not a valid file-timer request."""


class FileTimerRequest(TimerRequest):
    """A :class:`TimerRequest` of the file timers: the worker is a pid, with a signal.

    Args:
        worker_pid: the pid to signal when the timer runs out.
        scope_id: names the timer within the worker.
        expiration_time: wall-clock second at which it runs out; negative releases.
        signal: the signal to send; 0 or less means "report, but do not signal".
    """

    __slots__ = ("signal", "version")

    def __init__(
        self, worker_pid: int, scope_id: str, expiration_time: float, signal: int = 0
    ) -> None:
        super().__init__(worker_pid, scope_id, expiration_time)
        self.version = 1
        self.signal = signal

    @property
    def worker_pid(self) -> int:
        return cast(int, self.worker_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileTimerRequest):
            return False
        return (
            super().__eq__(other) and self.version == other.version and self.signal == other.signal
        )

    __hash__ = None  # deliberately unhashable, like its base

    def to_json(self) -> str:
        """The wire form: one JSON object, the same keys torch writes."""
        return json.dumps(
            {
                "version": self.version,
                "pid": self.worker_pid,
                "scope_id": self.scope_id,
                "expiration_time": self.expiration_time,
                "signal": self.signal,
            }
        )

    @classmethod
    def from_json(cls, line: str | bytes) -> FileTimerRequest:
        """Parse one wire line.

        Raises:
            TimerRequestError: not JSON, not an object, a missing or mistyped field, or
                an unknown version.
        """
        try:
            data = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TimerRequestError(f"not JSON: {line[:200]!r}") from exc
        if not isinstance(data, dict):
            raise TimerRequestError(f"not a JSON object: {line[:200]!r}")
        version = data.get("version", 1)
        pid, scope_id = data.get("pid"), data.get("scope_id")
        expiration, sig = data.get("expiration_time"), data.get("signal", 0)
        if version != 1:
            raise TimerRequestError(f"unknown timer request version {version!r}")
        if not isinstance(pid, int) or not isinstance(scope_id, str) or not _is_int(sig):
            raise TimerRequestError(f"bad pid, scope_id or signal in {data!r}")
        if isinstance(pid, bool) or isinstance(expiration, bool):
            raise TimerRequestError(f"a boolean where a number belongs in {data!r}")
        if not isinstance(expiration, int | float):
            raise TimerRequestError(f"bad expiration_time in {data!r}")
        return cls(pid, scope_id, float(expiration), sig)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class FileTimerClient(TimerClient):
    """Client of :class:`FileTimerServer`: writes requests to its FIFO.

    The worker id is this process's pid. Each request opens the FIFO without blocking
    (a server that is gone must not hang the worker), writes one line and closes it.

    Args:
        file_path: the FIFO the server created (``TORCHELASTIC_TIMER_FILE``).
        signal: the signal the server sends when a timer runs out; 0 or less asks the
            server only to report it.
    """

    def __init__(self, file_path: str, signal: int = _signal.SIGKILL) -> None:
        self._file_path = file_path
        self.signal = signal

    def _open(self) -> int:
        last: OSError | None = None
        for attempt in range(_OPEN_ATTEMPTS):
            if attempt:
                time.sleep(_OPEN_RETRY_INTERVAL)
            try:
                # ENXIO: no reader has the FIFO open (the server is not up, or gone).
                fd = os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                last = exc
                continue
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            last = OSError(errno.EINVAL, "not a FIFO", self._file_path)
        raise BrokenPipeError(
            f"timer server is not available at {self._file_path}: {last}"
        ) from last

    def _send(self, request: FileTimerRequest) -> None:
        payload = (request.to_json() + "\n").encode()
        # Writes of at most PIPE_BUF bytes are atomic: lines of concurrent workers never
        # interleave. A longer one could, so it is refused.
        if len(payload) > select.PIPE_BUF:
            raise RuntimeError(
                f"timer request of {len(payload)} bytes exceeds PIPE_BUF ({select.PIPE_BUF}); "
                f"use a shorter scope id: {payload[:200]!r}"
            )
        fd = self._open()
        try:
            for attempt in range(_OPEN_ATTEMPTS):
                if attempt:
                    time.sleep(_OPEN_RETRY_INTERVAL)
                try:
                    os.write(fd, payload)
                    return
                except BlockingIOError:
                    continue  # the pipe is full; the server drains it continuously
            raise BrokenPipeError(f"timer server at {self._file_path} is not reading")
        finally:
            os.close(fd)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm ``scope_id`` for this pid.

        Raises:
            BrokenPipeError: the server is not available.
            RuntimeError: the request is longer than ``PIPE_BUF``.
        """
        self._send(FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        """Disarm ``scope_id`` for this pid (expiration time -1).

        Raises:
            BrokenPipeError: the server is not available.
        """
        self._send(FileTimerRequest(os.getpid(), scope_id, -1, 0))

    def __repr__(self) -> str:
        return f"FileTimerClient(file_path={self._file_path!r}, signal={self.signal})"


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
        self._file_path = file_path
        self._private_dir: str | None = None
        self._run_id = run_id
        self._max_interval = max_interval
        self._daemon = daemon
        self._log_event = log_event
        self._on_expired = on_expired
        self._clock = clock
        self._timers: TimerTable[FileTimerRequest] = TimerTable()
        self._lock = threading.Lock()  # guards _timers against readers on other threads
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._rfd = -1
        self._wfd = -1  # our own writer: the FIFO never reads EOF, and stop() wakes poll
        self._pending = b""
        self._request_count = 0  # torch's tests read this name
        self._client_seen = False
        self._last_progress_time = int(clock.time())

    @property
    def file_path(self) -> str | None:
        """The FIFO path (None before :meth:`start` when no path was given)."""
        return self._file_path

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
        if self._thread is not None:
            return
        self._make_fifo()
        try:
            flags = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
            self._rfd = os.open(cast(str, self._file_path), os.O_RDONLY | flags)
            if not stat.S_ISFIFO(os.fstat(self._rfd).st_mode):
                raise OSError(errno.EINVAL, "not a FIFO", self._file_path)
            self._wfd = os.open(cast(str, self._file_path), os.O_WRONLY | flags)
        except OSError:
            self._close_and_remove()
            raise
        self._stopping.clear()
        self._pending = b""
        log.info("starting %r", self)
        self._thread = threading.Thread(
            target=self._watchdog_loop, name="FileTimerServer-watchdog", daemon=self._daemon
        )
        self._thread.start()
        self._emit("watchdog started", None)

    def stop(self) -> None:
        """Stop the watchdog (promptly: it is woken, not waited for) and remove the FIFO.

        Idempotent; never raises for cleanup problems (they are logged).
        """
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wake()
            thread.join(max(self._max_interval, 1.0))
            if thread.is_alive():
                # Closing descriptors under a live thread could make it read a reused fd.
                log.error("timer watchdog thread did not stop; leaving its FIFO open")
                return
        self._close_and_remove()
        if thread is not None:
            self._emit("watchdog stopped", None)

    def run_once(self) -> None:
        """Process what is already in the FIFO, then stop (a helper for tests, as torch's)."""
        self.stop()

    def _make_fifo(self) -> None:
        if self._requested_path is None:
            # A fresh private directory: nobody else can pre-create, replace or write it.
            self._private_dir = tempfile.mkdtemp(prefix="elastrun-timer-")
            self._file_path = os.path.join(self._private_dir, "watchdog_timer")
        else:
            self._file_path = self._requested_path
            try:
                os.unlink(self._file_path)
            except FileNotFoundError:
                pass  # nothing to replace
        os.mkfifo(self._file_path, 0o600)

    def _close_and_remove(self) -> None:
        for fd in (self._rfd, self._wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:
                    log.warning("closing the timer FIFO: %s", exc)
        self._rfd = self._wfd = -1
        if self._file_path is not None:
            try:
                if stat.S_ISFIFO(os.lstat(self._file_path).st_mode):
                    os.unlink(self._file_path)
            except FileNotFoundError:
                pass  # already removed by someone else; that is what we wanted
            except OSError as exc:
                log.warning("removing the timer FIFO %s: %s", self._file_path, exc)
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
            self._file_path = None

    def _wake(self) -> None:
        try:
            os.write(self._wfd, b"\n")  # an empty line, skipped by the parser
        except OSError as exc:  # full pipe (poll is readable anyway) or already closed
            log.debug("waking the timer watchdog: %s", exc)

    # -- the watchdog ----------------------------------------------------------------

    def _watchdog_loop(self) -> None:
        poller = select.poll()
        poller.register(self._rfd, select.POLLIN)
        while not self._stopping.is_set():
            try:
                self._run_watchdog(poller)
            except Exception:
                log.exception("timer watchdog pass failed")
                self._stopping.wait(self._max_interval)

    def _wait_timeout(self) -> float:
        """How long to wait for requests: until the next timer runs out, at most max_interval."""
        with self._lock:
            nxt = self._timers.next_expiration()
        timeout = self._max_interval
        if nxt is not None:
            left = nxt - self._clock.time()
            # A timer already past (a reap to retry) waits the full interval: no spin.
            if left > 0:
                timeout = min(timeout, left)
        return timeout

    def _run_watchdog(self, poller: select.poll) -> None:
        if poller.poll(max(0, int(self._wait_timeout() * 1000) + 1)):
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
            self._notify_expired(decision)
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

    def _notify_expired(self, decision: ReapDecision) -> None:
        if self._on_expired is None:
            return
        try:
            self._on_expired(decision.pid, decision.scope_id, decision.signal)
        except Exception:
            log.exception("on_expired callback failed for pid %s", decision.pid)

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
        gone: set[Hashable] = set(worker_pids)
        with self._lock:
            gone |= {p for p in self._timers.workers() if not self.is_process_running(cast(int, p))}
            self._timers.clear(gone)

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
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[:1]
        except OSError:
            return True  # no procfs (or it just vanished): kill(pid, 0) has the last word
        return state != [b"Z"]

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
        running = self._thread is not None and self._thread.is_alive()
        return (
            f"FileTimerServer(file_path={self._file_path!r}, run_id={self._run_id!r}, "
            f"max_interval={self._max_interval}, running={running}, timers={len(self._timers)})"
        )


def file_timer_enabled(env: Mapping[str, str]) -> bool:
    """Whether ``TORCHELASTIC_ENABLE_FILE_TIMER`` is ``1`` (unset, empty or ``0``: off).

    Raises:
        ConfigError: any other value, naming the variable.
    """
    raw = env.get(TORCHELASTIC_ENABLE_FILE_TIMER, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(TORCHELASTIC_ENABLE_FILE_TIMER, raw, "must be 1 (on), 0 or empty (off)")
    return raw == "1"


class AgentFileTimer:
    """The agent's file-timer watchdog: one :class:`FileTimerServer` and what it reaped.

    Usage by the agent: ``timer = AgentFileTimer.from_env(os.environ)`` at the edge
    (None when ``TORCHELASTIC_ENABLE_FILE_TIMER`` is not ``1``); ``path =
    timer.start(run_id)`` before starting workers and export it to them as
    ``TORCHELASTIC_TIMER_FILE`` (:meth:`worker_env`); when a worker exits, look its pid
    up in :meth:`expired_pids`; ``timer.stop()`` when the workers are stopped.

    Args:
        file_path: the FIFO path (``TORCHELASTIC_TIMER_FILE`` of the agent's
            environment, as torch honours it); None for a fresh private directory.
        max_interval: the watchdog's longest sleep. Timers are acted on when they run
            out whatever this is; it bounds how stale the progress time can get.
        on_expired: also called with ``(pid, scope_id, signal)`` before a worker is
            signalled (on the watchdog thread).
        log_event: forwarded to :class:`FileTimerServer`.
        clock: the wall clock for expiration times.
    """

    def __init__(
        self,
        file_path: str | None = None,
        *,
        max_interval: float = 1.0,
        on_expired: OnExpired | None = None,
        log_event: LogEvent | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not max_interval > 0:
            raise ConfigError("max_interval", max_interval, "must be a positive number of seconds")
        self._file_path = file_path
        self._max_interval = max_interval
        self._on_expired = on_expired
        self._log_event = log_event
        self._clock = clock
        self._server: FileTimerServer | None = None
        self._expired: dict[int, str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        *,
        max_interval: float = 1.0,
        on_expired: OnExpired | None = None,
        log_event: LogEvent | None = None,
    ) -> AgentFileTimer | None:
        """The watchdog the agent's environment asks for, or None when it asks for none.

        Raises:
            ConfigError: ``TORCHELASTIC_ENABLE_FILE_TIMER`` is neither empty, ``0`` nor
                ``1`` (torch silently treats anything but ``1`` as off).
        """
        if not file_timer_enabled(env):
            return None
        return cls(
            env.get(TORCHELASTIC_TIMER_FILE) or None,
            max_interval=max_interval,
            on_expired=on_expired,
            log_event=log_event,
        )

    @property
    def file_path(self) -> str | None:
        """The FIFO path while running, else None."""
        return self._server.file_path if self._server is not None else None

    def start(self, run_id: str) -> str:
        """Start the watchdog (if not running) and return the FIFO path for the workers.

        Also forgets reaps recorded before: pids of an earlier round may be reused.

        Raises:
            OSError: the FIFO could not be created.
        """
        with self._lock:
            self._expired.clear()
        if self._server is None:
            server = FileTimerServer(
                self._file_path,
                run_id,
                max_interval=self._max_interval,
                log_event=self._log_event,
                on_expired=self._record,
                clock=self._clock,
            )
            server.start()
            self._server = server
        return cast(str, self._server.file_path)

    def worker_env(self) -> dict[str, str]:
        """``{"TORCHELASTIC_TIMER_FILE": path}`` while running, else empty."""
        path = self.file_path
        return {TORCHELASTIC_TIMER_FILE: path} if path is not None else {}

    def _record(self, pid: int, scope_id: str, sig: int) -> None:
        with self._lock:
            self._expired[pid] = scope_id
        if self._on_expired is not None:
            self._on_expired(pid, scope_id, sig)

    def expired_pids(self) -> dict[int, str]:
        """pid -> scope of workers reaped for an expired timer since the last call.

        A pid is recorded before its signal is sent, so it is here by the time the
        agent sees that worker exit.
        """
        with self._lock:
            out, self._expired = self._expired, {}
        return out

    def get_last_progress_time(self) -> int:
        """The watchdog's last pass (wall-clock second); now when it is not running."""
        if self._server is None:
            return int(self._clock.time())
        return self._server.get_last_progress_time()

    def stop(self) -> None:
        """Stop the watchdog and remove its FIFO. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def __repr__(self) -> str:
        return (
            f"AgentFileTimer(file_path={self.file_path!r}, running={self._server is not None}, "
            f"unreported_expired={len(self._expired)})"
        )
