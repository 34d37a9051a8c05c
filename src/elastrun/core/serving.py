"""A request loop for the standard library's socket servers that stops at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socketserver

    from elastrun.core.cancel import CancelScope


def serve_until_cancelled(scope: CancelScope, server: socketserver.TCPServer) -> None:
    """Handle ``server``'s requests until ``scope`` is cancelled (raises ``Cancelled``).

    Used instead of ``serve_forever()``: cancelling the scope (closing the nursery the
    loop runs in) wakes it at once, rather than after ``serve_forever``'s polling
    interval on every exit. ``handle_request()`` runs only once the listening socket is
    readable: the server should give it a zero ``timeout`` (and a non-blocking socket),
    so that a connection gone in between cannot block the loop, and so its stop.
    """
    while True:
        scope.wait_readable(server.fileno())
        server.handle_request()
