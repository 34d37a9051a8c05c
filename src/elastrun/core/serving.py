"""A request loop for the standard library's socket servers that stops at once."""

from __future__ import annotations

import selectors
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socketserver


def serve_until_woken(server: socketserver.BaseServer, wake: socket.socket) -> None:
    """Handle ``server``'s requests until ``wake`` becomes readable.

    Used instead of ``serve_forever()``: stopping wakes this loop at once through
    ``wake``, rather than after ``serve_forever``'s polling interval on every exit.
    """
    with selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)  # type: ignore[arg-type]  # has fileno()
        selector.register(wake, selectors.EVENT_READ)
        while True:
            ready = selector.select()
            if any(key.fileobj is wake for key, _ in ready):
                return
            server.handle_request()
