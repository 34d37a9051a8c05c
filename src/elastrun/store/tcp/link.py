"""One connection of the tcp store client: dialling it, its handshake, and its traffic.

A :class:`Connection` is one authenticated socket shared by every thread of a client:
requests carry ids, callers send under a lock and wait on their own :class:`Pending`,
and one reader thread hands each answer to its caller. The reader lives as long as the
socket: it runs in the connection's own nursery, whose cancel cuts the socket, and it
ends when the socket does (the server hung up, a caller gave up on it, or the client
closed it). Reconnecting, backoff and the outage window are the dialer's
(:mod:`.dialer`), which dials with :func:`connect` and authenticates with :func:`handshake`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import StoreAuthError
from elastrun.core.threads import Nursery
from elastrun.store.tcp import protocol as p

# The client's logger: a connection is part of the client, not a component of its own.
log = logging.getLogger("elastrun.store.tcp.client")


class Pending:
    """One request waiting for its answer, which is due at ``due`` (monotonic: when it
    was sent, plus the time a ``watch`` or ``wait`` may take on the server)."""

    __slots__ = ("_done", "answer", "due", "lost")

    # ``interrupt`` wakes the waiter with neither an answer nor a loss: its scope was
    # cancelled (the caller stops waiting; a late answer is dropped).

    def __init__(self, due: float) -> None:
        self._done = threading.Event()
        self.answer: p.Message | None = None
        self.lost = False
        self.due = due

    def resolve(self, answer: p.Message) -> None:
        self.answer = answer
        self._done.set()

    def fail(self) -> None:
        self.lost = True
        self._done.set()

    def interrupt(self) -> None:
        self._done.set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


class NotSent(Exception):
    """The request never fully left this process: sending it again is always safe."""


class Refused(Exception):
    """The server turned this client away for good (not a transient failure)."""


class Connection:
    """One authenticated socket, its reader thread and the requests awaiting answers."""

    def __init__(
        self,
        sock: socket.socket,
        buf: bytearray,
        max_frame: int,
        label: str,
        on_lost: Callable[[Connection], None],
    ) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._buf = buf
        self._on_lost = on_lost
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()  # guards _pending, alive, and closing the socket
        self._send_lock = threading.Lock()  # one frame at a time on the wire
        self.alive = True
        self._label = label
        self._nursery = Nursery()  # the reader's: see start_reading and close

    def start_reading(self) -> None:
        """Start the reader thread (the dialer does, once it has published the
        connection: its ``close`` must find it).

        Raises:
            RuntimeError: the connection is closed, or no thread can be started.
        """
        self._nursery.start(self._read_loop, name=f"elastrun-store-client {self._label}")

    @property
    def reading(self) -> bool:
        """Whether the reader thread still runs (it may outlive the socket a while: it
        reconnects a client that holds leases, see the dialer's ``_on_lost``)."""
        return bool(self._nursery.running())

    def close(self, timeout: float) -> bool:
        """Cut the connection and wait up to ``timeout`` for its reader to end (pending
        calls failed, the socket closed); whether it did. Idempotent; never raises."""
        return not self._nursery.close("the client was closed", timeout)

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed"
        return f"Connection({state}, pending={len(self._pending)})"

    def send(self, rid: int, frame: bytes, due: float) -> Pending:
        pending = Pending(due)
        with self._lock:
            if not self.alive:
                raise NotSent
            self._pending[rid] = pending
        try:
            with self._send_lock:
                self.sock.sendall(frame)
        except OSError:
            # sendall fails before the kernel took the whole frame: the server never
            # saw a complete request, so it cannot have applied it.
            with self._lock:
                self._pending.pop(rid, None)
            self.abort()
            raise NotSent from None
        return pending

    def forget(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def overdue_since(self) -> float | None:
        """When the earliest answer still owed was due (None: none is owed). A request
        whose caller stopped waiting at its deadline stays owed until its answer comes
        (and is dropped): the server's silence is measured across callers."""
        with self._lock:
            return min((q.due for q in self._pending.values()), default=None)

    def abort(self) -> None:
        """Cut the connection; the reader thread notices, fails pending calls, cleans up."""
        with self._lock:
            if self.alive:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def _read_loop(self, scope: CancelScope) -> None:
        try:
            with scope.wakes(self.abort):  # (the recv below ends with the socket)
                while True:
                    answer = p.recv_frame(self.sock, self.max_frame, self._buf)
                    rid = answer.get("id")
                    with self._lock:
                        pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
                    if pending is not None:
                        pending.resolve(answer)
        except (OSError, p.FrameError) as exc:  # ConnectionError is an OSError
            log.debug("store connection closed: %r", exc)
        finally:
            with self._lock:
                self.alive = False
                orphans = list(self._pending.values())
                self._pending.clear()
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # unblocks a sender stuck on a full buffer
            with self._send_lock:
                self.sock.close()  # never under a sender: its descriptor could be reused
            for pending in orphans:
                pending.fail()
            self._on_lost(self)


class Welcome(NamedTuple):
    """What a successful handshake leaves: the bytes read past the welcome, the
    server's largest frame, and the resumed leases that expired meanwhile."""

    buf: bytearray
    max_frame: int
    lost: list[int]


def handshake(
    sock: socket.socket,
    where: str,
    token: str | None,
    resume: Callable[[], list[int]],
) -> Welcome:
    """Answer the server's challenge with a hello naming the leases to ``resume`` (read
    once the challenge came) and read its welcome.

    Raises ``StoreAuthError`` for a refused token, :class:`Refused` when the server
    turns this client away for good, ``FrameError``/``OSError`` otherwise.
    """
    buf = bytearray()
    challenge = p.recv_frame(sock, p.HANDSHAKE_MAX_FRAME, buf)
    if challenge.get("type") != "challenge":
        raise p.FrameError(f"the server at {where} did not send a challenge")
    if challenge.get("version") != p.PROTOCOL_VERSION:
        raise Refused(
            f"the store at {where} speaks protocol version "
            f"{challenge.get('version')}, this client {p.PROTOCOL_VERSION}"
        )
    nonce = p.unb64(challenge.get("nonce"), "nonce")
    max_frame = p.get_int(challenge, "max_frame")
    proof = None
    if challenge.get("auth") is True and token is not None:
        proof = p.proof(token, nonce)
    hello = {
        "type": "hello",
        "version": p.PROTOCOL_VERSION,
        "proof": proof,
        "resume": resume(),
    }
    sock.sendall(p.encode(hello, p.HANDSHAKE_MAX_FRAME))
    reply = p.recv_frame(sock, max(max_frame, p.HANDSHAKE_MAX_FRAME), buf)
    if reply.get("type") == "error":
        if reply.get("code") == p.CODE_AUTH:
            raise StoreAuthError(f"store at {where} refused authentication: wrong or missing token")
        raise Refused(f"the store at {where} refused: {reply.get('message')}")
    if reply.get("type") != "welcome":
        raise p.FrameError(f"the server at {where} did not welcome us")
    return Welcome(buf, max_frame, p.get_int_list(reply, "lost"))


def connect(address: tuple[str, int], timeout: float, scope: CancelScope) -> socket.socket:
    """A connected socket (blocking, with ``timeout``); the connect is non-blocking
    underneath so that a cancelled scope ends it at once."""
    host, port = address
    error: OSError | None = None
    until = time.monotonic() + timeout
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            code = sock.connect_ex(addr)
            if code in (errno.EINPROGRESS, errno.EAGAIN):
                with selectors.DefaultSelector() as sel:
                    sel.register(sock, selectors.EVENT_WRITE)
                    sel.register(scope.fileno(), selectors.EVENT_READ)
                    sel.select(max(0.0, until - time.monotonic()))
                scope.raise_if_cancelled()
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0 and not _connected(sock):
                    code = errno.ETIMEDOUT
            if code:
                raise OSError(code, os.strerror(code))
            sock.settimeout(max(0.001, until - time.monotonic()))
            return sock
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError):
                raise
            error = exc
    raise error if error is not None else OSError(f"cannot resolve {host!r}")


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True
