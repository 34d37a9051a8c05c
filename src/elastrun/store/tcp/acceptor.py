"""Accepting connections within a descriptor budget.

asyncio's accept loop (``loop.create_server``) knows no budget: a flood of connections
that never authenticate takes every descriptor the process has, and once accept() fails
with EMFILE, CPython 3.11 logs a traceback for each further try -- up to the backlog per
loop tick -- while the process (an agent, with workers to restart) has nothing left for
its own work. So the stores accept by themselves -- the rendezvous store and the
workers' store's Python engine through this acceptor, the workers' store's compiled
engine by the same rules, with the numbers this module computes (``wirecore.c``):

- it stops accepting while fewer than a reserve of descriptors are free, or while too
  many connections have not authenticated yet; the others wait in the kernel's listen
  backlog, which costs this process nothing, and are taken once there is room;
- it makes room among the unauthenticated by closing the oldest one that has had
  ``EVICT_AFTER`` to say hello (a real client does within milliseconds), so a flood
  cycles through instead of holding the door shut for the handshake timeout -- when
  too many are waiting, and also when the reserve is reached (the descriptors then go
  back to the process, or to the next connection);
- it says that it stopped (and why), and that it resumed, in one line each -- at most
  one of each kind every 30 s -- never a line per connection.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, cast

from elastrun.store.tcp.limits import LogLimiter, fd_limit, fd_reserve, open_fds

log = logging.getLogger("elastrun.store.tcp.server")

#: Thousands of agents may connect at once after a restart; the kernel caps this.
BACKLOG = 4096
#: Connections taken per wake-up: requests of connected clients are served in between.
ACCEPT_BATCH = 64
#: At most this many connections waiting to authenticate (fewer under a low fd limit).
MAX_HANDSHAKES = 256
#: An unauthenticated connection this old may be closed to make room for a new one
#: (a real client's hello comes one round trip after the challenge). Under a flood the
#: store takes ``max_handshakes / EVICT_AFTER`` connections a second.
EVICT_AFTER = 0.5
#: While not accepting, look again this often (besides whenever a connection ends).
RECHECK = 0.5
#: Count the open descriptors (a directory listing) at most this often.
RECOUNT_EVERY = 0.25
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def max_handshakes(limit: int, reserve: int) -> int:
    """How many connections may wait to authenticate at once, under descriptor ``limit``
    less ``reserve``: half of the room left now at most (the other half is for clients
    that authenticated; the reserve is checked apart from this), within 4 ..
    ``MAX_HANDSHAKES``."""
    room = limit - reserve - (open_fds() or 0)
    return max(4, min(MAX_HANDSHAKES, room // 2))


class Handshaking(Protocol):
    """A connection as the acceptor sees it: it may be closed to make room while it has
    not authenticated, and is told when its socket could not be served after all."""

    def close_unauthenticated(self) -> None: ...

    def close(self) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...


C = TypeVar("C", bound=Handshaking)


class Admissions(Generic[C]):
    """The connections of the service the acceptor accepts for (Hub, Service).

    ``conns``: every connection served; ``handshaking``: those not authenticated yet,
    oldest first, with when each came in (a connection leaves it when it authenticates
    or closes); ``unauthenticated_closed``: how many were closed before authenticating;
    ``on_room``: set by the acceptor, called by :meth:`room` when a connection ends or
    authenticates. ``make`` builds a connection (an ``asyncio.Protocol``) for a socket.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, make: Callable[[], C]) -> None:
        self.loop = loop
        self._make = make
        self.conns: set[C] = set()
        self.handshaking: dict[C, float] = {}
        self.unauthenticated_closed = 0
        self.on_room: Callable[[], None] | None = None

    def admit(self) -> C:
        """A connection for a socket the acceptor hands over, counted from now on."""
        conn = self._make()
        self.register(conn)
        return conn

    def register(self, conn: C) -> None:
        """Count ``conn``, as one that has not authenticated yet, from the moment its
        socket is handed over (asyncio calls ``connection_made`` a loop turn later: the
        acceptor's budgets must not miss it in between); idempotent."""
        self.conns.add(conn)
        self.handshaking.setdefault(conn, self.loop.time())

    def room(self) -> None:
        """A connection ended or authenticated: the acceptor may take more."""
        if self.on_room is not None:
            self.on_room()


class Acceptor(Generic[C]):
    """Accepts connections on listening sockets for ``service``, within a budget.

    Args:
        service: what the connections are served by (its loop runs this acceptor).
        socks: bound listening sockets; the acceptor owns them from now on.
        limit: the process's descriptor limit (default: its soft limit now).
        reserve: descriptors always left free (default: ``fd_reserve(limit)``).
        handshakes: connections that may wait to authenticate at once (default:
            ``max_handshakes(limit, reserve)``).
        name: what the log lines call the server.
        handshake: what a connection through the handshake did, in them.
        logger: where they go.
    """

    def __init__(
        self,
        service: Admissions[C],
        socks: list[socket.socket],
        *,
        limit: int | None = None,
        reserve: int | None = None,
        handshakes: int | None = None,
        name: str = "the store",
        handshake: str = "authenticated",
        logger: logging.Logger = log,
    ) -> None:
        self._service = service
        self._loop = service.loop
        self._socks = socks
        self._limit = fd_limit() if limit is None else limit
        self._reserve = fd_reserve(self._limit) if reserve is None else reserve
        self.max_handshakes = (
            max_handshakes(self._limit, self._reserve) if handshakes is None else handshakes
        )
        self._name, self._handshake = name, handshake
        self._starting: set[socket.socket] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._paused: str | None = None  # why, while not accepting
        self._retry: asyncio.TimerHandle | None = None
        self._counted = (-math.inf, 0, 0)  # when, descriptors open, connections then
        self._limiter = LogLimiter(logger, self._loop.time, every=30.0, burst=1)
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"paused ({self._paused})" if self._paused else "on"
        return (
            f"Acceptor({state}, connections={len(self._service.conns)}, "
            f"handshaking={len(self._service.handshaking)}/{self.max_handshakes}, "
            f"limit={self._limit}, reserve={self._reserve})"
        )

    def start(self) -> None:
        """Listen and accept from now on; a failure closes the sockets."""
        try:
            for sock in self._socks:
                sock.setblocking(False)
                sock.listen(BACKLOG)
            self._service.on_room = self._on_room
            self._listen()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop accepting and close the listening sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._service.on_room = None
        if self._paused is None:
            self._unlisten()
        if self._retry is not None:
            self._retry.cancel()
        for sock in [*self._socks, *self._starting]:
            sock.close()

    async def shut_down(self, turns: int) -> None:
        """Close this acceptor and every connection, let ``turns`` loop iterations pass
        (aborted transports report ``connection_lost``), then cancel the loop's other
        tasks (requests and hand-overs still under way) and wait for them."""
        self.close()
        for conn in list(self._service.conns):
            conn.close()
        for _ in range(turns):
            await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _listen(self) -> None:
        for sock in self._socks:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _unlisten(self) -> None:
        for sock in self._socks:
            self._loop.remove_reader(sock.fileno())

    # -- accepting -----------------------------------------------------------------------

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            full = self._full()
            if full is not None:
                self._pause(*full)
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause("accept", f"accept() failed: {exc.strerror}")
                else:
                    self._limiter.log(
                        logging.WARNING, "accept", "could not accept a connection: %s", exc
                    )
                return
            self._starting.add(conn)
            task = self._loop.create_task(self._hand_over(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _hand_over(self, sock: socket.socket) -> None:
        if self._closed:  # the server stopped before this task ran: close() closed it
            self._starting.discard(sock)
            return
        made: list[C] = []

        def serve() -> asyncio.BaseProtocol:
            # The socket moves from "starting" to the service's connections (and
            # handshakes) in one step: counted in both, or in neither, the budgets would
            # drift by one for each connection in between (``_full``, ``_free_fds``).
            conn = self._service.admit()
            self._starting.discard(sock)
            made.append(conn)
            # (``Admissions.admit`` makes an asyncio protocol; the type says less)
            return cast(asyncio.BaseProtocol, conn)

        try:
            await self._loop.connect_accepted_socket(serve, sock)
        except OSError as exc:  # the peer left already
            log.debug("could not start serving an accepted connection: %r", exc)
            sock.close()
            for conn in made:
                if conn in self._service.conns:  # asyncio had not reported it lost
                    conn.connection_lost(exc)
        finally:
            self._starting.discard(sock)

    def _full(self) -> tuple[str, str] | None:
        """Why no connection may be taken now (a kind and a reason), or None."""
        service = self._service
        waiting = len(service.handshaking) + len(self._starting)
        if waiting >= self.max_handshakes and not self._evict_oldest():
            return "handshakes", f"{waiting} connections have not {self._handshake} yet"
        free = self._free_fds()
        if free <= self._reserve:
            # The oldest that has had its time makes room: for this process's own work,
            # or (once it is gone, ``_on_room``) for the next connection. Idle strangers
            # then cannot hold the door shut however few descriptors the process has.
            self._evict_oldest()
            return "descriptors", (
                f"{free} descriptors are free (limit {self._limit}; {self._reserve} are kept "
                "for this process's own work)"
            )
        return None

    def _evict_oldest(self) -> bool:
        oldest = next(iter(self._service.handshaking.items()), None)
        if oldest is None or self._loop.time() - oldest[1] < EVICT_AFTER:
            return False
        oldest[0].close_unauthenticated()
        return True

    def _free_fds(self) -> int:
        now = self._loop.time()
        conns = len(self._service.conns) + len(self._starting)
        at, fds, then = self._counted
        if now - at >= RECOUNT_EVERY:
            counted = open_fds()
            fds, then = (counted, conns) if counted is not None else (conns, conns)
            self._counted = (now, fds, then)
        # Between counts, only our own connections come and go fast enough to matter.
        return self._limit - (fds + conns - then)

    # -- pausing -------------------------------------------------------------------------

    def _pause(self, kind: str, why: str) -> None:
        if self._paused is None:
            self._unlisten()
            self._paused = why
            self._limiter.log(
                logging.WARNING,
                kind,
                "%s is not accepting connections for now: %s; they wait in the listen backlog",
                self._name,
                why,
            )
        if self._retry is None:
            self._retry = self._loop.call_later(RECHECK, self._recheck)

    def _recheck(self) -> None:
        self._retry = None
        self._on_room()

    def _on_room(self) -> None:
        if self._paused is None or self._closed:
            return
        if (full := self._full()) is not None:
            self._pause(*full)  # paused already: it only looks again later
            return
        self._paused = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._listen()
        self._limiter.log(
            logging.INFO,
            "resume",
            "%s accepts connections again (%d open; %d closed so far that had not %s)",
            self._name,
            len(self._service.conns),
            self._service.unauthenticated_closed,
            self._handshake,
        )
