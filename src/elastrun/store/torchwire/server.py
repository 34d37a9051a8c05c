"""The server that torch's TCPStore clients talk to: sockets and lifecycle.

``start()`` binds and listens in the caller's thread -- the port is known when it
returns, and a client may connect at once (the kernel queues it until the loop runs)
-- then one daemon thread, in the server's nursery, serves every connection, on one of
two engines (``close()`` cancels the nursery's scope, which asks the engine to stop, and
joins the thread):

* ``compiled``: ``wirecore``, the same rules in C on an epoll loop of its own, with no
  Python per request and the GIL given up while it serves. Built by the install where a
  C compiler is found (Linux); the default where it was built.
* ``python``: an asyncio (or uvloop) loop; what a connection does is in ``connection``,
  the table it serves in ``state``. They are the definition of the protocol's rules:
  the contract tests hold both engines to them, and to torch's own server.

``ELASTRUN_STORE_ENGINE=python`` (or ``compiled``) overrides the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import ConfigError, StoreError
from elastrun.core.eventloop import new_event_loop
from elastrun.core.threads import Nursery

# The rendezvous store's acceptor, the numbers of its budget, its listening sockets:
from elastrun.store.tcp.acceptor import EVICT_AFTER, RECHECK, RECOUNT_EVERY, Acceptor
from elastrun.store.tcp.connection import format_addr
from elastrun.store.tcp.limits import LogLimiter, bind_listeners, fd_limit, fd_reserve, open_fds
from elastrun.store.tcp.protocol import tune_socket
from elastrun.store.torchwire import codec
from elastrun.store.torchwire.connection import Connection, Hub
from elastrun.store.torchwire.engine import choose_engine
from elastrun.store.torchwire.lazy import BACKLOG
from elastrun.store.torchwire.limits import DEFAULT_MAX_CONNECTIONS, Complaints, Limits

if TYPE_CHECKING:
    # A package-level import: the import-contract checker sees no extension modules.
    from elastrun.store.torchwire import wirecore

log = logging.getLogger("elastrun.store.torchwire")
T = TypeVar("T")

#: How long close() waits for the server thread.
CLOSE_TIMEOUT = 5.0


def _admission(limits: Limits) -> tuple[int, int, int]:
    """Who may connect, as numbers both engines use: the descriptor limit, the reserve
    kept free under it, and how many connections may wait to validate."""
    limit = fd_limit()
    reserve = fd_reserve(limit)
    # Every descriptor above the reserve, where the rendezvous store allows 256 (half
    # of them under a low limit): the ranks of a large job connect at once, and where
    # many share a loaded machine (or a load generator runs thousands of clients in
    # one process), many send their validation later than EVICT_AFTER after the
    # kernel took their connection. At 256 -- and at half of 20,000 descriptors -- a
    # burst of 10,000 such clients had hundreds closed to make room (torch's client
    # then retries after a back-off). What the cap guards is the descriptors, and at
    # the reserve the oldest waiting connection makes room all the same (the
    # acceptor's rule): a flood of idle connections still cycles through.
    room = limit - reserve - (open_fds() or 0)
    return limit, reserve, limits.max_handshakes or max(4, room)


class TorchWireServer:
    """Serves a key-value store to torch's ``TCPStore`` clients, without torch.

    It speaks the protocol of torch 2.13's TCPStore (the libuv server's semantics), so
    workers started with ``TORCHELASTIC_USE_AGENT_STORE=True`` and ``MASTER_ADDR``/
    ``MASTER_PORT`` pointing here bootstrap their process groups from it -- and the
    store outlives any one worker.

    Args:
        host: address to listen on; ``""`` means every interface (IPv4 and IPv6), a
            name with several addresses (``localhost``) is bound on all of them.
        port: port to listen on; 0 picks a free one (returned by :meth:`start`).
        max_connections: clients served at once; a connection beyond it is closed at
            once (torch's client retries until its timeout).
        max_handshakes: connections that have not sent torch's validation yet, at once
            (default: every descriptor above the reserve). Beyond it, and at the
            reserve, the oldest one is closed when it has had ``EVICT_AFTER`` to
            validate, else accepting pauses (the others wait in the listen backlog);
            validated clients are served on.
        max_frame: largest request in bytes -- in practice, the largest value a client
            may store (torch's own server stops at 8 MiB).
        max_key: longest key in bytes.
        loop_factory: makes the event loop the Python engine runs on; by default
            uvloop's when it is installed (``elastrun.core.eventloop``), else asyncio's.
        engine: ``"compiled"``, ``"python"`` or ``"auto"`` (see :func:`choose_engine`).

    A client that exceeds a limit or breaks the protocol has its own connection
    closed; no other client notices. Either engine stops accepting while no more than a
    reserve of descriptors is free (``elastrun.store.tcp.limits.fd_reserve``): the
    process hosting it keeps those for its own work. The constructor does no I/O; it
    raises ``ConfigError`` for a bad argument.

    Hosting notes: serve each round of workers from a fresh server (torch's agent
    starts a new store per round too), so keys of a failed attempt cannot be read by
    the next one. Each client holds a descriptor: thousands of workers need the
    process's open-file limit raised (``elastrun.store.tcp.raise_fd_limit``). Do not
    host it in a process that itself calls torch's client: some of torch's calls
    (``queue_pop``, ``list_keys``, ``barrier``...) keep the GIL while they block, and
    this server's thread would never get to answer them.
    """

    def __init__(
        self,
        host: str = "",
        port: int = 0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_frame: int = codec.DEFAULT_MAX_FRAME,
        max_key: int = codec.DEFAULT_MAX_KEY,
        *,
        max_handshakes: int | None = None,
        sockets: list[socket.socket] | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_event_loop,
        engine: str = "auto",
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError("port", port, "must be in 0..65535")
        self._limits = Limits(max_connections, max_frame, max_key, max_handshakes)
        #: ``"compiled"`` or ``"python"``: what serves the clients.
        self.engine = choose_engine(engine)
        self._core: wirecore.Core | None = None  # the compiled engine's
        # Listening sockets bound by the caller (see ``lazy``); the server then owns them.
        self._given = sockets
        self._loop_factory = loop_factory
        self.host = host
        self._requested_port = port
        self._port: int | None = None
        self._lock = threading.Lock()
        self._started = False
        self.closed = False  # close() was called
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._hub: Hub | None = None
        # The serving thread's; close() closes it, and its scope's cancel reaches the
        # engine (``_request_stop``) from whichever thread closes the server.
        self._nursery = Nursery(join_timeout=CLOSE_TIMEOUT)
        self._nursery.scope.on_cancel(self._request_stop)

    @property
    def port(self) -> int:
        """The port listened on (the chosen one when constructed with port 0).

        Raises ``StoreError`` before :meth:`start`.
        """
        if self._port is None:
            raise StoreError("the torch store server is not listening yet")
        return self._port

    @property
    def num_keys(self) -> int:
        """Keys holding a value, as ``get_num_keys`` counts them."""
        if self._core is not None:
            return int(self._core.num_keys)
        return self._hub.state.num_keys if self._hub is not None else 0

    @property
    def num_connections(self) -> int:
        """Clients connected now."""
        if self._core is not None:
            return int(self._core.num_connections)
        return len(self._hub.conns) if self._hub is not None else 0

    def start(self) -> int:
        """Bind and listen in this thread, then serve from a daemon thread.

        Returns the port. Raises ``StoreError`` naming ``host:port`` when the address
        cannot be bound, or when called twice. Must not be called from a thread
        running an asyncio loop (binding uses a loop of its own, run here).
        """
        with self._lock:
            if self._started or self.closed:
                raise StoreError("this torch store server was already started or closed")
            self._started = True
        if self.engine == "compiled":
            return self._start_compiled()
        loop = self._loop_factory()
        hub = Hub(loop, self._limits)
        acceptor = self._bind(loop, self._listen(hub))
        stop = asyncio.Event()
        with self._lock:
            self._loop, self._stop, self._hub = loop, stop, hub
        return self._serve_from(self._run, (loop, acceptor, hub, stop))

    def _bind(self, loop: asyncio.AbstractEventLoop, binding: Coroutine[Any, Any, T]) -> T:
        """Run ``binding`` on ``loop``; a failure closes the loop and is a ``StoreError``
        naming the address."""
        try:
            return loop.run_until_complete(binding)
        except (OSError, RuntimeError) as exc:
            loop.close()
            where = format_addr(self.host or "*", self._requested_port)
            raise StoreError(f"cannot listen on {where}: {exc}") from exc

    async def _bound(self) -> list[socket.socket]:
        """The listening sockets (given, or bound now), tuned; sets the port."""
        socks = self._given or bind_listeners(self.host, self._requested_port)
        for sock in socks:  # accepted sockets inherit these (see LISTENER_OPTIONS_INHERITED)
            tune_socket(sock)
        self._port = int(socks[0].getsockname()[1])
        return socks

    def _serve_from(self, target: Callable[..., None], args: tuple[object, ...]) -> int:
        """Start the serving thread (its engine's state already published); the port.

        Under the lock that close() takes first: either the thread starts before
        close() closes the nursery, or close() came while start() bound, and what it
        made is ended here (the engine stops at once: the request was made first).
        """
        where = format_addr(self.host or "*", self.port)
        with self._lock:
            closed = self.closed
            if not closed:
                self._nursery.start(target, *args, name=f"elastrun-torchwire {where}")
        if closed:
            self._request_stop()
            target(self._nursery.scope, *args)
        else:
            log.debug("serving torch store clients on %s (%s engine)", where, self.engine)
        return self.port

    def close(self) -> None:
        """Stop accepting, close every connection and end the thread; never raises.

        Idempotent. Waits for the server thread up to ``CLOSE_TIMEOUT`` seconds (not
        when called from that thread; the nursery warns of a thread that outlives it).
        Not from a signal handler: cancelling the scope takes locks. None of ours calls
        it there: the workers' store (``lazy``) closes it from the agent's loop, and
        starts it on a thread of its own, where Python runs no signal handler.
        """
        with self._lock:
            self.closed = True
        self._nursery.close("closed")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving" if self._nursery.running() else "new"
        where = format_addr(self.host or "*", self._port or self._requested_port)
        return (
            f"TorchWireServer({where}, {state}, keys={self.num_keys}, "
            f"connections={self.num_connections})"
        )

    # -- the loop ------------------------------------------------------------------------

    def _start_compiled(self) -> int:
        from elastrun.store.torchwire import wirecore  # built by the install

        binder = asyncio.new_event_loop()  # (``_bind`` runs the binding on a loop)
        socks = self._bind(binder, self._bound())
        binder.close()
        try:
            for sock in socks:
                sock.setblocking(False)
                sock.listen(BACKLOG)  # again for given sockets: it only sets the backlog
            complaints = Complaints(time.monotonic)
            limit, reserve, handshakes = _admission(self._limits)
            notices = LogLimiter(log, time.monotonic, every=30.0, burst=1)
            core = wirecore.Core(
                [s.fileno() for s in socks],
                self._limits.max_connections,
                self._limits.max_frame,
                self._limits.max_key,
                lambda message: complaints("%s", message),
                max_handshakes=handshakes,
                fd_limit=limit,
                fd_reserve=reserve,
                evict_after_ms=round(EVICT_AFTER * 1000),
                recheck_ms=round(RECHECK * 1000),
                recount_ms=round(RECOUNT_EVERY * 1000),
                notice=lambda kind, message: notices.log(
                    logging.INFO if kind == "resume" else logging.WARNING, kind, "%s", message
                ),
            )
        except OSError as exc:
            for sock in socks:
                sock.close()
            raise StoreError(f"cannot serve the torch store: {exc}") from exc
        with self._lock:
            self._core = core
        return self._serve_from(self._run_compiled, (core, socks))

    @staticmethod
    def _run_compiled(scope: CancelScope, core: wirecore.Core, socks: list[socket.socket]) -> None:
        try:
            core.serve()
        except Exception:
            log.exception("the torch store server stopped on an error")
        finally:
            for sock in socks:
                sock.close()
            log.debug("the torch store server stopped (%d keys held)", core.num_keys)

    def _request_stop(self) -> None:
        if self._core is not None:
            self._core.stop()
            return
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed in between: nothing to stop
            loop.call_soon_threadsafe(stop.set)

    async def _listen(self, hub: Hub) -> Acceptor[Connection]:
        socks = await self._bound()
        limit, reserve, handshakes = _admission(self._limits)
        acceptor = Acceptor(
            hub,
            socks,
            limit=limit,
            reserve=reserve,
            handshakes=handshakes,
            name="the workers' store",
            handshake="validated",
            logger=log,
        )
        acceptor.start()
        return acceptor

    def _run(
        self,
        scope: CancelScope,
        loop: asyncio.AbstractEventLoop,
        acceptor: Acceptor[Connection],
        hub: Hub,
        stop: asyncio.Event,
    ) -> None:
        # (No set_event_loop: nothing here asks for the thread's loop outside of it, and
        # a close() during start() runs this in start()'s thread, whose loop is not ours.)
        try:
            loop.run_until_complete(self._serve(acceptor, hub, stop))
        except Exception:
            log.exception("the torch store server stopped on an error")
        finally:
            try:
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    async def _serve(self, acceptor: Acceptor[Connection], hub: Hub, stop: asyncio.Event) -> None:
        try:
            await stop.wait()
        finally:
            await acceptor.shut_down(turns=3)
            log.debug("the torch store server stopped (%d keys held)", hub.state.num_keys)
