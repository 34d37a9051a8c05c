"""The standard library's socket servers, served on threads of a nursery: a request loop
that stops at once, and each request answered on a thread that the nursery joins.

``Served(server, name)`` runs ``server``'s request loop (``serve_until_cancelled``) on a
thread of its own nursery; a server class that derives from ``NurseryRequests`` (in
place of ``ThreadingMixIn``) answers each request on another thread of that nursery.
``Served.close()`` cancels the nursery's scope, which wakes the loop and shuts down the
sockets of the requests still being answered (a kept-alive connection waiting for its
next request ends at once), joins every thread within the nursery's bound and closes
the listening socket; a second close, also from another thread, returns only once all
of that is done. Nothing of a closed server is left running or open.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from typing import Any, Self

from elastrun.core.cancel import CancelScope
from elastrun.core.threads import Nursery

__all__ = ["Endpoint", "NurseryRequests", "Served", "serve_until_cancelled"]


def serve_until_cancelled(scope: CancelScope, server: NurseryRequests) -> None:
    """Handle ``server``'s requests until ``scope`` is cancelled (raises ``Cancelled``).

    Used instead of ``serve_forever()``: cancelling the scope (closing the nursery the
    loop runs in) wakes it at once, rather than after ``serve_forever``'s polling
    interval on every exit. ``handle_request()`` runs only once the listening socket is
    readable: the server should give it a zero ``timeout`` (and a non-blocking socket,
    as ``NurseryRequests`` does), so that a connection gone in between cannot block the
    loop, and so its stop.
    """
    while True:
        scope.wait_readable(server.fileno())
        server.handle_request()


class NurseryRequests(socketserver.BaseServer):
    """A socket server's requests, each answered on a thread of ``nursery`` (set by
    ``Served``); first in a server class's bases, before the standard library's server.

    Its listening socket is non-blocking and its ``timeout`` zero (see
    ``serve_until_cancelled``). What the answer raises goes to ``handle_error``; the
    request's socket is shut down when the nursery's scope is cancelled, and closed
    when the answer ends."""

    timeout = 0.0
    socket: socket.socket
    nursery: Nursery
    #: The name of the threads that answer requests.
    request_thread = "elastrun-request"

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)  # (what it accepts is blocking)

    def fileno(self) -> int:
        return self.socket.fileno()

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            self.nursery.start(self._answer, request, client_address, name=self.request_thread)
        except RuntimeError:  # the nursery is closed: the server is stopping
            self.shutdown_request(request)

    def _answer(self, scope: CancelScope, request: Any, client_address: Any) -> None:
        with scope.wakes(lambda: _shut_down(request)):
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)


def _shut_down(request: socket.socket) -> None:
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class Served:
    """``server`` (a ``NurseryRequests`` server, bound and listening) serving on the
    threads of a nursery of its own (closed within the nursery's default bound), named
    ``name``, until :meth:`close`."""

    def __init__(self, server: NurseryRequests, name: str) -> None:
        self.server = server
        self.nursery = server.nursery = Nursery()
        self._lock = threading.Lock()
        self.nursery.start(serve_until_cancelled, server, name=name)

    @property
    def port(self) -> int:
        """The port the server listens on (a TCP server's)."""
        return int(self.server.socket.getsockname()[1])

    def close(self, reason: str = "closed") -> None:
        """Stop serving, answer no more requests and close the listening socket;
        idempotent, never raises (a thread still running after the bound is logged)."""
        with self._lock:
            self.nursery.close(reason)
            self.server.server_close()

    def __repr__(self) -> str:
        return f"Served({type(self.server).__name__}, {self.nursery!r})"


class Endpoint:
    """What a TCP server that serves through :class:`Served` shares: its port, ``stop``
    and its use as a context manager; ``start`` binds and sets ``_served`` (a fresh one
    per start)."""

    _requested_port: int
    _served: Served | None = None

    def start(self) -> object:
        raise NotImplementedError

    @property
    def port(self) -> int:
        """The bound port once started (the one asked for, 0 for any, before)."""
        return self._requested_port if self._served is None else self._served.port

    def stop(self) -> None:
        """Stop serving and free the port. Idempotent; never raises."""
        served, self._served = self._served, None
        if served is not None:
            served.close("stopped")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
