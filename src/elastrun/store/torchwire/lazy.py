"""The workers' store as the agent hosts it: listening at once, serving on first use.

Binding is synchronous and cheap, so the port is the agent's before any worker starts
and no other process can take it. The server itself (asyncio, the protocol modules:
tens of milliseconds of imports on the launch path) is started only when the first
client connects -- which never happens for workers that do not use torch.distributed,
and for those that do happens after their own much longer torch import. Until then the
kernel queues connections on the listening socket.

This module imports nothing heavy; keep it that way.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from typing import TYPE_CHECKING

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import StoreError
from elastrun.core.threads import Nursery
from elastrun.store.tcp.limits import bind_listeners

if TYPE_CHECKING:
    from elastrun.store.torchwire.server import TorchWireServer

log = logging.getLogger("elastrun.store.torchwire")

#: Pending connections the kernel keeps before the server accepts (a large job's
#: workers connect at once).
BACKLOG = 4096
_JOIN_TIMEOUT = 5.0


class LazyTorchWireServer:
    """A :class:`TorchWireServer` that listens from :meth:`start` on and starts serving
    when the first client connects. Same ``start``/``close``/``port`` contract."""

    def __init__(self, host: str = "", port: int = 0) -> None:
        self._host = host
        self._requested_port = port
        self._socks: list[socket.socket] = []
        self._port: int | None = None  # (read once: the sockets close with the server)
        self._server: TorchWireServer | None = None
        self._nursery = Nursery(join_timeout=_JOIN_TIMEOUT)  # close() closes it
        self._lock = threading.Lock()  # the thread starts no server once it is cancelled

    @property
    def port(self) -> int:
        if self._port is None:
            raise StoreError("the workers' store is not listening yet")
        return self._port

    @property
    def serving(self) -> bool:
        """Whether a client came and the server runs."""
        return self._server is not None

    def start(self) -> int:
        """Bind and listen now; serve from the first connection on. Returns the port.

        Raises:
            StoreError: the address cannot be bound, or the process is out of
                descriptors or threads.
        """
        try:
            self._socks = bind_listeners(self._host, self._requested_port, BACKLOG)
        except OSError as exc:
            where = f"{self._host or '*'}:{self._requested_port}"
            raise StoreError(f"cannot listen on {where}: {exc}") from exc
        self._port = int(self._socks[0].getsockname()[1])
        try:
            self._nursery.scope.fileno()  # made here: out of descriptors is start()'s error
            self._nursery.start(self._serve_on_first_client, name="elastrun-workers-store")
        except (OSError, RuntimeError) as exc:  # out of descriptors, or of threads
            where = f"{self._host or '*'}:{self.port}"
            self.close()
            raise StoreError(f"cannot serve the workers' store on {where}: {exc}") from exc
        return self.port

    def _serve_on_first_client(self, scope: CancelScope) -> None:
        try:  # until a client connects, or close() cancels the scope
            select.select([s.fileno() for s in self._socks] + [scope.fileno()], [], [])
        except (OSError, ValueError):
            return  # closed under us
        with self._lock:
            if scope.cancelled:
                return
            try:
                from elastrun.store.torchwire.server import TorchWireServer

                server = TorchWireServer(self._host, self.port, sockets=self._socks)
                server.start()
            except Exception as exc:  # reported below; the clients must not wait
                # Clients would wait in the backlog until their timeout: refuse them now.
                log.error("the workers' store could not start: %s", exc)
                for sock in self._socks:
                    sock.close()
                return
            self._server = server

    def close(self) -> None:
        """Stop serving and listening; idempotent, never raises."""
        with self._lock:
            if self._nursery.scope.cancelled:
                return
            self._nursery.scope.cancel("closed")  # wakes the thread's select
            server = self._server
        self._nursery.close()  # joins it (and frees the scope's descriptor)
        if server is not None:
            server.close()  # it owns the sockets now
        else:
            for sock in self._socks:
                sock.close()

    def __repr__(self) -> str:
        closed = self._nursery.scope.cancelled
        state = "closed" if closed else "serving" if self._server else "listening"
        where = f"{self._host or '*'}:{self._port or self._requested_port}"
        return f"LazyTorchWireServer({where}, {state})"
