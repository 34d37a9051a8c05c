"""Keeping one connection of the tcp store client up across outages.

The :class:`Dialer` owns the client's connection and its leases: it dials on demand --
one dialer at a time, with exponential backoff and full jitter -- names the leases in
the hello so that the server re-attaches them, and reconnects at once in the background
when a connection that held leases drops. Giving up is one window per outage, shared by
every caller (see :mod:`elastrun.store.tcp.client`). A caller's deadline ends its own
wait (``StoreTimeoutError``), never the window: a dial it cuts short is the next
caller's to make.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import threading
import time

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import Deadline
from elastrun.core.errors import (
    StoreAuthError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from elastrun.store.tcp import protocol as p
from elastrun.store.tcp.link import Connection, Refused, connect, handshake

# The client's logger: the dialer is part of the client, not a component of its own.
log = logging.getLogger("elastrun.store.tcp.client")

_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 1.0
_JOIN_TIMEOUT = 5.0
#: Longest single connection attempt (handshake included); the dialer then retries.
_ATTEMPT_CAP = 5.0
#: Shortest one: the last attempt of a window, or a call's one attempt after it, gets
#: this long for the connection and the handshake even when less of the window is left.
_ATTEMPT_MIN = 0.5


def past_deadline(what: str, where: str, *, unknown: bool) -> StoreTimeoutError:
    """A call that its scope's deadline ended (``unknown``: a write that may have been
    applied)."""
    note = "; it may or may not have been applied" if unknown else ""
    return StoreTimeoutError(
        f"{what}: no answer from the store at {where} before the caller's deadline{note}"
    )


class Dialer:
    """The connection of one client to ``where`` (``host``, ``port``) and its leases.

    ``connect_timeout``: how long to keep trying to reach the server, counted from the
    moment it stopped answering. :meth:`connection` raises ``StoreAuthError``,
    ``StoreUnavailableError``, ``StoreError`` (closed, refused) and ``Cancelled``.
    """

    def __init__(
        self, host: str, port: int, where: str, token: str | None, connect_timeout: float
    ) -> None:
        self._host = host
        self._port = port
        self._where = where
        self._token = token
        self.currentect_timeout = connect_timeout
        self._lock = threading.Lock()  # guards current, _leases, _readers, _dialing
        self._dialer = threading.Condition()  # one dialer at a time (``_dial_busy``)
        self._dial_busy = False
        #: Cancelled by :meth:`close`: every wait of the client runs under it.
        self.life = CancelScope()
        #: The connection last established (alive or not), if any.
        self.current: Connection | None = None
        self._leases: set[int] = set()
        self._readers: list[Connection] = []  # whose reader threads may still run
        self._dialing: socket.socket | None = None
        self._closed = threading.Event()
        # The outage: when the server stopped answering (None while connected), whether
        # it ever answered, and the end of the last window that ran out: (when, message).
        self._down_since: float | None = None
        self._ever_connected = False
        self._failed: tuple[float, str] | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def state(self) -> str:
        """``closed``, ``connected`` or ``disconnected`` (for reprs)."""
        if self._closed.is_set():
            return "closed"
        conn = self.current
        return "connected" if conn is not None and conn.alive else "disconnected"

    def closed_error(self, what: str = "") -> StoreError:
        """The error of a call (``what``) made or cut short by :meth:`close`."""
        call = f"{what}: " if what else ""
        return StoreError(f"{call}the client of the store at {self._where} is closed")

    def went_silent(self, conn: Connection, since: float) -> None:
        """``conn`` has not answered a request sent at ``since``: unless it was already
        replaced or an outage is under way, the outage counts from then."""
        with self._lock:
            if self.current is conn and self._down_since is None:
                self._down_since = since

    def hold(self, lease: int) -> None:
        """Resume ``lease`` on every reconnection."""
        with self._lock:
            self._leases.add(lease)

    def release(self, lease: int) -> None:
        with self._lock:
            self._leases.discard(lease)

    def leases(self) -> list[int]:
        """The leases held, as a hello names them for the server to re-attach them."""
        with self._lock:
            return sorted(self._leases)

    def connection(self, scope: CancelScope) -> Connection:
        """The live connection, dialling it (or waiting for the dialer) when there is none."""
        conn = self.current
        if conn is not None and conn.alive:
            return conn
        asked = time.monotonic()
        self._take_dialer(scope, asked)
        try:
            if self._closed.is_set():
                raise self.closed_error()
            conn = self.current
            if conn is not None and conn.alive:
                return conn
            failed = self._failed_since(asked)
            if failed is not None:
                raise failed
            conn = self._dial(scope)
            with self._lock:
                if self._closed.is_set():
                    conn.sock.close()
                    raise self.closed_error()
                self.current = conn
                self._readers = [c for c in self._readers if c.reading]
                self._readers.append(conn)
                # Started under the lock: ``close`` either finds it reading, or ran
                # before and was seen above.
                conn.start_reading()
            return conn
        finally:
            with self._dialer:
                self._dial_busy = False
                self._dialer.notify_all()

    def _take_dialer(self, scope: CancelScope, asked: float) -> None:
        """Become the one dialer; a cancelled scope, or its deadline, stops queueing
        behind another."""

        def wake() -> None:
            with self._dialer:
                self._dialer.notify_all()

        with self._dialer, scope.wakes(wake):
            while self._dial_busy:
                scope.raise_if_cancelled()
                if scope.expired():  # unless a window ran out meanwhile, it alone gives up
                    raise self._failed_since(asked) or past_deadline(
                        "connecting", self._where, unknown=False
                    )
                self._dialer.wait(scope.deadline.timeout())
            scope.raise_if_cancelled()
            self._dial_busy = True

    def _dial(self, scope: CancelScope) -> Connection:
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
            deadline = self._down_since + self.currentect_timeout
        delay = _BACKOFF_FIRST
        while True:
            if scope.expired():  # the window is still open: only this caller gives up
                raise past_deadline("connecting", self._where, unknown=False)
            try:
                attempt = max(_ATTEMPT_MIN, min(_ATTEMPT_CAP, deadline - time.monotonic()))
                conn = self._open(scope.remaining(attempt), scope)
            except StoreAuthError:
                raise  # retrying cannot fix a wrong token
            except Refused as exc:
                raise StoreError(str(exc)) from None
            except (OSError, p.FrameError, p.BadRequest) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                if self._closed.is_set():
                    raise self.closed_error() from exc
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._give_up(reason) from exc  # also past the caller's deadline
            else:
                with self._lock:
                    self._down_since = self._failed = None
                    self._ever_connected = True
                return conn
            # Full jitter keeps a thousand agents that lost the server together from
            # coming back in lockstep.
            scope.sleep(min(left, random.uniform(delay / 2, delay)))
            delay = min(_BACKOFF_CAP, delay * 2)

    def _failed_since(self, asked: float) -> StoreUnavailableError | None:
        """The outcome of a window that ran out since a call ``asked`` for a connection,
        which is that call's too (N queued calls must not each try again in turn)."""
        with self._lock:
            failed = self._failed
        return self._unavailable(failed[1]) if failed and failed[0] >= asked else None

    def _give_up(self, reason: str) -> StoreUnavailableError:
        """The window ran out: remember its outcome for the calls queued behind it."""
        now = time.monotonic()
        with self._lock:
            message = f"cannot reach the store at {self._where}: {reason}"
            if self._ever_connected:
                since = self._down_since if self._down_since is not None else now
                message += f"; it has not answered for {now - since:.0f}s"
            self._failed = (now, message)
        return self._unavailable(message)

    def _unavailable(self, message: str) -> StoreUnavailableError:
        with self._lock:
            since = self._down_since
        silent = time.monotonic() - since if since is not None else 0.0
        return StoreUnavailableError(message, address=self._where, silent_for=silent)

    def _open(self, timeout: float, scope: CancelScope) -> Connection:
        # Short attempts; the connect itself ends at once when the scope is cancelled.
        sock = connect((self._host, self._port), timeout, scope)
        with self._lock:
            self._dialing = sock
        try:
            p.tune_socket(sock)
            welcome = handshake(sock, self._where, self._token, self.leases)
            if welcome.lost:
                log.warning(
                    "store at %s: leases %s expired while reconnecting", self._where, welcome.lost
                )
                with self._lock:
                    self._leases.difference_update(welcome.lost)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        finally:
            with self._lock:
                self._dialing = None
        return Connection(sock, welcome.buf, welcome.max_frame, self._where, self._on_lost)

    def _on_lost(self, conn: Connection) -> None:
        # Runs on the dead connection's reader thread. Leases must be resumed within the
        # server's grace period, which an idle client would miss: reconnect right away.
        with self._lock:
            eager = bool(self._leases) and not self._closed.is_set() and self.current is conn
        if not eager:
            return
        try:
            self.connection(self.life)
        except Cancelled:
            return  # closed meanwhile
        except StoreError as exc:
            # Debug only: every caller waiting meanwhile gets this very outcome, and
            # says it in its own terms (the rendezvous: one line naming the store).
            log.debug(
                "lost the connection to the store at %s and could not reconnect; "
                "its leases will expire: %s",
                self._where,
                exc,
            )

    def close(self) -> None:
        """Drop the connection, end every wait and join the reader threads (within
        ``_JOIN_TIMEOUT`` in all); idempotent."""
        self._closed.set()
        self.life.cancel("the client was closed")
        with self._lock:
            dialing, readers = self._dialing, list(self._readers)
        if dialing is not None:
            with contextlib.suppress(OSError):
                dialing.shutdown(socket.SHUT_RDWR)
        deadline = Deadline.after(_JOIN_TIMEOUT)
        for conn in readers:
            conn.close(deadline.remaining())
        self.life.close()

    def __repr__(self) -> str:
        return f"Dialer({self._where}, {self.state}, leases={sorted(self._leases)})"
