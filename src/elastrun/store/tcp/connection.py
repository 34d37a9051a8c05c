"""One client connection of the tcp store, as an ``asyncio.Protocol``: how requests are
answered, and what a stranger who says nothing costs, is in ``service``'s docstring.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, cast

from elastrun.store.tcp import protocol as p

if TYPE_CHECKING:
    from elastrun.store.tcp.service import Service

log = logging.getLogger("elastrun.store.tcp.server")

#: A connection that has not said hello by then is dropped (it holds a descriptor); a
#: real client says hello within milliseconds of the challenge.
HANDSHAKE_TIMEOUT = 5.0


def format_addr(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Connection(asyncio.Protocol):
    """One client connection: handshake first, then requests, until it closes."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._nonce = os.urandom(p.NONCE_BYTES)
        self._ready = False  # the hello was accepted
        self._closed = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        self.peer = "?"
        self.leases: set[int] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "ready" if self._ready else "handshake"
        return f"Connection({self.peer}, {state}, leases={sorted(self.leases)})"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream server's
        if self._closed:  # evicted between the hand-over and now
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        self.peer = format_addr(str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                p.tune_socket(sock)
            except OSError as exc:  # the peer may already be gone; the read will tell
                log.debug("socket options for %s: %r", self.peer, exc)
        service = self._service
        service.register(self)
        self._handshake_timer = service.loop.call_later(
            HANDSHAKE_TIMEOUT, self._handshake_timed_out
        )
        self.send(service.challenge(self._nonce))

    def _handshake_timed_out(self) -> None:
        if not self._ready and not self._closed:
            self._service.limiter.log(
                logging.WARNING,
                "handshake",
                "closing the connection from %s: no hello within %gs",
                self.peer,
                HANDSHAKE_TIMEOUT,
            )
            self.close_unauthenticated()

    def close_unauthenticated(self) -> None:
        """Close a connection that has not authenticated (timed out, or makes room)."""
        if not self._ready and not self._closed:
            self._service.unauthenticated_closed += 1
        self.close()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            while not self._closed:
                limit = self._service.max_frame if self._ready else p.HANDSHAKE_MAX_FRAME
                if len(self._buf) < p.HEADER.size:
                    return
                # Checked as soon as the header is in: an oversized frame is refused
                # before a byte of its body is buffered.
                length = p.frame_length(bytes(self._buf[: p.HEADER.size]), limit)
                end = p.HEADER.size + length
                if len(self._buf) < end:
                    return
                message = p.decode(bytes(self._buf[p.HEADER.size : end]))
                del self._buf[:end]
                if self._ready:
                    self._service.dispatch(self, message)
                elif self._service.hello(self, message, self._nonce):
                    self._ready = True
                    if self._handshake_timer is not None:
                        self._handshake_timer.cancel()
                    self._service.handshaking.pop(self, None)
                    self._service.room()
                else:
                    self.close()  # refused: nothing after the hello is read
        except p.FrameError as exc:
            self._service.limiter.log(
                logging.WARNING, "frame", "closing the connection from %s: %s", self.peer, exc
            )
            self.close()

    def send(self, frame: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame)

    def close(self) -> None:
        """Flush what was sent and close; reading stops at once."""
        self._closed = True
        self._service.handshaking.pop(self, None)
        if self._transport is not None:
            self._transport.close()

    # A client that does not read its answers must not make us buffer without bound.
    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._buf.clear()
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        service = self._service
        service.conns.discard(self)
        service.handshaking.pop(self, None)
        for task in list(self.tasks):
            task.cancel()
        service.leases.orphan(self)
        log.debug("connection from %s closed (%r)", self.peer, exc)
        service.room()
