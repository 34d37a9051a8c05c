"""The tcp store server: lifecycle (a thread of its own, or the foreground). What it
serves, and how, is in ``service``; the ``elastrun store`` command that runs it on its own
is :mod:`elastrun.launch.commands.store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import ConfigError, StoreError
from elastrun.core.threads import Nursery
from elastrun.core.values import parse_int, parse_port, parse_seconds
from elastrun.store.memory import HISTORY, MemoryStore
from elastrun.store.tcp import protocol as p
from elastrun.store.tcp.acceptor import Acceptor
from elastrun.store.tcp.limits import bind_listeners
from elastrun.store.tcp.service import Connection, Service, format_addr

log = logging.getLogger(__name__)

DEFAULT_DISCONNECT_GRACE = 2.0
#: The largest --max-frame accepted (1 GiB): frames are held in memory whole.
MAX_FRAME_LIMIT = 1 << 30


class TcpStoreServer:
    """Serves one in-memory store over TCP to many ``TcpStore`` clients.

    Args:
        host: address to listen on; a name that resolves to several addresses
            (``localhost``: 127.0.0.1 and ::1) is bound on all of them, on one port.
        port: port to listen on; 0 picks a free one (see :attr:`port`).
        token: shared secret; when set, a client must prove it holds it (HMAC over a
            random nonce) before anything is served.
        max_frame: largest frame accepted or sent, in bytes.
        disconnect_grace: seconds a dropped client has to reconnect and resume its
            leases before they are revoked (never longer than a lease's TTL).
        history: how many past changes a watch can resume from.

    The constructor does no I/O (it raises ``ConfigError`` for a bad argument): call
    :meth:`start` (background thread) or :meth:`serve_forever` (this thread), then
    :meth:`stop`. Leases are held per connection: see ``service``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_frame: int = p.DEFAULT_MAX_FRAME,
        disconnect_grace: float = DEFAULT_DISCONNECT_GRACE,
        *,
        history: int = HISTORY,
    ) -> None:
        parse_port(port, "port")
        parse_int(max_frame, "max_frame", low=p.HANDSHAKE_MAX_FRAME, high=MAX_FRAME_LIMIT)
        parse_seconds(disconnect_grace, "disconnect_grace")
        if token is not None and not token:
            raise ConfigError("token", token, "must not be empty")
        self.host = host
        self._requested_port = port
        self._token = token
        self._max_frame = max_frame
        self._grace = disconnect_grace
        self._history = history
        self._port: int | None = None
        self._lock = threading.Lock()
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None  # the loop's, set on its thread
        self._service: Service | None = None
        # One start per server, so one nursery: stop() closes it, and its scope's cancel
        # wakes the loop (from whichever thread stops it: ``elastrun store`` stops its
        # server from the launcher's signal relay, never in a signal handler).
        self._nursery = Nursery(join_timeout=None)
        self._nursery.scope.on_cancel(self._wake_loop)

    @property
    def port(self) -> int:
        """The port being listened on (the chosen one when constructed with port 0)."""
        if self._port is None:
            raise StoreError("the store server is not listening yet")
        return self._port

    def start(self) -> None:
        """Listen and serve from a background thread; returns once listening.

        Raises ``StoreError`` when the address cannot be bound.
        """
        self._claim_start()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run(scope: CancelScope) -> None:
            try:
                asyncio.run(self._main(ready.set, scope))
            except BaseException as exc:
                if ready.is_set():  # it failed while serving: nobody to hand it to
                    log.error("the store server stopped on an error", exc_info=exc)
                else:  # it failed to start: start() raises it
                    failure.append(exc)
                    ready.set()

        try:
            thread = self._nursery.start(
                run, name=f"elastrun-store-server {self.host}:{self._requested_port}"
            )
        except RuntimeError:
            if self._nursery.closed:
                return  # stopped before it started: nothing to serve
            raise
        ready.wait()
        if failure:
            thread.join()
            raise self._bind_error(failure[0])

    def serve_forever(self, on_ready: Callable[[int], None] | None = None) -> None:
        """Listen and serve in this thread until :meth:`stop` is called.

        ``on_ready(port)`` is called once listening. Raises ``StoreError`` when the
        address cannot be bound.
        """
        self._claim_start()

        def ready() -> None:
            if on_ready is not None:
                on_ready(self.port)

        try:
            asyncio.run(self._main(ready, self._nursery.scope))
        except OSError as exc:
            raise self._bind_error(exc) from exc

    def stop(self) -> None:
        """Close every connection and stop serving; idempotent, and never raises.

        From another thread it also waits for the server thread to finish. Not from a
        signal handler: cancelling takes locks (``elastrun store`` relays its signals).
        """
        self._nursery.close("stopped")  # without a bound, as the thread's owner waits

    def _wake_loop(self) -> None:
        with self._lock:
            loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(event.set)

    def _claim_start(self) -> None:
        with self._lock:
            if self._started:
                raise StoreError("this store server was already started")
            self._started = True

    def _bind_error(self, exc: BaseException) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        where = format_addr(self.host, self._requested_port)
        return StoreError(f"cannot listen on {where}: {exc}")

    async def _main(self, ready: Callable[[], None], scope: CancelScope) -> None:
        loop = asyncio.get_running_loop()
        store = MemoryStore(history=self._history)
        # Wall-clock microseconds: numbering must keep growing across restarts of the
        # process, which the monotonic clock (per boot, per process) cannot promise.
        base = time.time_ns() // 1000
        service = Service(loop, store, self._token, self._max_frame, self._grace, base)
        stop = asyncio.Event()
        acceptor = self._listen(service)
        with self._lock:
            self._loop, self._stop_event, self._service = loop, stop, service
            if scope.cancelled:  # stopped before the loop could be woken
                stop.set()
        ready()
        try:
            await stop.wait()
        finally:
            # (connection_lost cancels the connections' watch tasks)
            await acceptor.shut_down(turns=1)
            with self._lock:
                self._loop = self._stop_event = None

    def _listen(self, service: Service) -> Acceptor[Connection]:
        socks = bind_listeners(self.host, self._requested_port)
        self._port = socks[0].getsockname()[1]
        acceptor = Acceptor(service, socks)
        acceptor.start()
        return acceptor

    def __repr__(self) -> str:
        service = self._service
        conns = len(service.conns) if service is not None else 0
        state = "stopped" if self._nursery.scope.cancelled else "running" if self._port else "new"
        return (
            f"TcpStoreServer({format_addr(self.host, self._port or self._requested_port)}, "
            f"{state}, connections={conns}, auth={self._token is not None})"
        )


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace removed).

    Raises ``StoreError`` when the file cannot be read or holds no token.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"cannot read the token file {path}: {exc}") from exc
    if not token:
        raise StoreError(f"the token file {path} is empty")
    return token
