"""The server side of the tcp store: one ``MemoryStore`` served to many connections.

Everything here runs on the server's event loop and only there. The loop owns the
store: each request is a short, non-blocking call on it (its lock is never contended,
so no call can stall the loop). Connections are ``asyncio.Protocol`` objects: a request
that can be answered at once is answered inside ``data_received``, with no task and no
extra loop iteration. Only ``watch`` and ``wait`` become tasks.

Waiting is event-driven: after every change the service reads the new events once and
wakes only the waiters whose prefix or keys they touch, so thousands of idle watchers
cost a future each -- no thread each, and no polling.

Leases belong to the connection that granted them. When it drops, its leases are
revoked after a short grace (``grace``, capped by each lease's TTL) unless the client
reconnects first and names them in its hello: a SIGKILLed agent's keys vanish within
about two seconds, while a brief network blip costs nothing. TTLs are enforced by one
timer per lease, so a watcher hears of an expiry when it happens, not at the next
request.

A stranger can open connections and say nothing: each one not authenticated within
``HANDSHAKE_TIMEOUT`` is closed, the acceptor (``acceptor``) caps how many may be
pending at once, and what they cause is logged through a ``LogLimiter`` -- a line per
kind every few seconds, never a line per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import cast

from elastrun.core.errors import (
    LeaseExpiredError,
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import EventKind, WatchEvent, WatchResult
from elastrun.store.memory import MemoryStore
from elastrun.store.tcp import protocol as p
from elastrun.store.tcp.limits import LogLimiter

log = logging.getLogger("elastrun.store.tcp.server")

#: A connection that has not said hello by then is dropped (it holds a descriptor); a
#: real client says hello within milliseconds of the challenge.
HANDSHAKE_TIMEOUT = 5.0
#: Lines a stranger can cause once per connection: at most one per kind this often.
LOG_EVERY = 10.0
#: A lease id the store never grants (its ids start at 1).
_NO_LEASE = -1


def format_addr(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _LeaseInfo:
    """What the loop knows of a lease: its TTL timer and the connection holding it."""

    __slots__ = ("deadline", "grace", "owner", "timer", "ttl")

    def __init__(self, ttl: float, deadline: float, owner: Connection) -> None:
        self.ttl = ttl
        self.deadline = deadline
        self.owner: Connection | None = owner
        self.timer: asyncio.TimerHandle | None = None
        self.grace: asyncio.TimerHandle | None = None


class _Waiters:
    """Blocked requests, indexed by what wakes them: a change under a prefix (watch) or
    the creation of a key (wait). A change costs a look at each distinct prefix, not at
    each waiter: thousands of nodes watching the same prefix cost one look."""

    def __init__(self) -> None:
        self.by_prefix: dict[str, set[asyncio.Future[None]]] = {}
        self.by_key: dict[str, set[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return sum(map(len, self.by_prefix.values())) + sum(map(len, self.by_key.values()))

    def __bool__(self) -> bool:
        return bool(self.by_prefix or self.by_key)

    def add(
        self, index: dict[str, set[asyncio.Future[None]]], what: str, fut: asyncio.Future[None]
    ) -> None:
        index.setdefault(what, set()).add(fut)

    def remove(
        self, index: dict[str, set[asyncio.Future[None]]], what: str, fut: asyncio.Future[None]
    ) -> None:
        futs = index.get(what)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del index[what]

    def wake(self, events: tuple[WatchEvent, ...] | None) -> None:
        if events is None:
            woken = [f for futs in (*self.by_prefix.values(), *self.by_key.values()) for f in futs]
        else:
            woken = []
            prefixes = list(self.by_prefix.items())
            for e in events:
                for prefix, futs in prefixes:
                    if e.key.startswith(prefix):
                        woken.extend(futs)
                if e.kind is EventKind.PUT:
                    woken.extend(self.by_key.get(e.key, ()))
        for fut in woken:
            if not fut.done():
                fut.set_result(None)


class Service:
    """The store, its lease bookkeeping, its waiters and the request handlers."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        store: MemoryStore,
        token: str | None,
        max_frame: int,
        grace: float,
        base: int,
    ) -> None:
        self.loop = loop
        self._base = base
        self.store = store
        self.token = token
        self.max_frame = max_frame
        self._grace = grace
        self._seen = store.revision
        self._waiters = _Waiters()
        self._leases: dict[int, _LeaseInfo] = {}
        self.conns: set[Connection] = set()
        #: Connections that have not authenticated yet, oldest first, with when each
        #: came in (the acceptor caps them and closes the oldest to make room).
        self.handshaking: dict[Connection, float] = {}
        #: Connections closed before they authenticated (timed out, or made room).
        self.unauthenticated_closed = 0
        #: Called when a connection ends or authenticates: the acceptor may take more.
        self.on_room: Callable[[], None] | None = None
        self.limiter = LogLimiter(log, loop.time, LOG_EVERY)
        self._quick: dict[str, Callable[[Connection, p.Message], object]] = {
            "get": self._get,
            "set": self._set,
            "add": self._add,
            "compare_set": self._compare_set,
            "delete": self._delete,
            "get_prefix": self._get_prefix,
            "grant_lease": self._grant_lease,
            "keep_alive": self._keep_alive,
            "revoke_lease": self._revoke_lease,
        }
        self._blocking: dict[str, Callable[[p.Message], Awaitable[object]]] = {
            "watch": self._watch,
            "wait": self._wait,
        }

    # -- numbering -----------------------------------------------------------------------
    #
    # Revisions and lease ids go on the wire offset by ``base`` (the server's start
    # time in microseconds), so they keep growing across server restarts. A client
    # that outlived a restart then holds numbers from before ``base``: its watch gets
    # StoreCompactedError (re-read, resume) instead of silently waiting for a revision
    # the new store will not reach for a while, and its old lease id can never name a
    # lease the new store granted to someone else.

    def _rev_out(self, revision: int) -> int:
        return revision + self._base

    def _rev_in(self, revision: int) -> int:
        if revision <= 0:
            return revision  # "from the very beginning"
        if revision < self._base:
            raise StoreCompactedError(
                f"revision {revision} is from before this store started (at revision "
                f"{self._base}); re-read and resume"
            )
        return revision - self._base

    def _lease_out(self, lease: int) -> int:
        return lease + self._base

    def _lease_in(self, lease: int) -> int:
        return lease - self._base if lease > self._base else _NO_LEASE

    def _opt_lease_in(self, m: p.Message) -> int | None:
        lease = p.get_opt_int(m, "lease")
        return None if lease is None else self._lease_in(lease)

    @contextlib.contextmanager
    def _lease_errors(self, m: p.Message) -> Iterator[None]:
        """Report a dead lease by the id the client knows it by."""
        try:
            yield
        except LeaseExpiredError:
            raise LeaseExpiredError(f"lease {m.get('lease')} has expired or was revoked") from None

    def _event_out(self, event: WatchEvent) -> WatchEvent:
        return dataclasses.replace(event, revision=self._rev_out(event.revision))

    def __repr__(self) -> str:
        return (
            f"Service(connections={len(self.conns)}, leases={len(self._leases)}, "
            f"waiters={len(self._waiters)}, revision={self._seen})"
        )

    # -- change fan-out ------------------------------------------------------------------

    def publish(self) -> None:
        """Wake the waiters interested in the changes made since the last call."""
        revision = self.store.revision
        if revision == self._seen:
            return
        if not self._waiters:
            self._seen = revision
            return
        try:
            result = self.store.watch("", self._seen, 0)
            events: tuple[WatchEvent, ...] | None = result.events
            self._seen = max(result.revision, revision)
        except StoreError:  # compacted: more changed at once than history keeps
            events = None
            self._seen = self.store.revision
        self._waiters.wake(events)

    async def _until_change(
        self, deadline: float, *, prefix: str | None = None, keys: Iterable[str] = ()
    ) -> None:
        """Wait until a change under ``prefix`` or the creation of one of ``keys``."""
        fut: asyncio.Future[None] = self.loop.create_future()
        w = self._waiters
        wanted = [(w.by_prefix, prefix)] if prefix is not None else []
        wanted += [(w.by_key, k) for k in keys]
        for index, what in wanted:
            w.add(index, what, fut)
        try:
            async with asyncio.timeout_at(None if math.isinf(deadline) else deadline):
                await fut
        except TimeoutError:
            pass  # the caller looks at the clock and answers "nothing yet"
        finally:
            for index, what in wanted:
                w.remove(index, what, fut)

    # -- leases --------------------------------------------------------------------------

    def _track(self, lease: int, ttl: float, owner: Connection) -> None:
        # Taken after the store call, so never earlier than the store's own deadline.
        info = _LeaseInfo(ttl, self.loop.time() + ttl, owner)
        info.timer = self.loop.call_at(info.deadline, self._on_deadline, lease)
        self._leases[lease] = info
        owner.leases.add(lease)

    def _forget(self, lease: int) -> None:
        info = self._leases.pop(lease, None)
        if info is None:
            return
        for handle in (info.timer, info.grace):
            if handle is not None:
                handle.cancel()
        if info.owner is not None:
            info.owner.leases.discard(lease)

    def _on_deadline(self, lease: int) -> None:
        info = self._leases.get(lease)
        if info is None:
            return
        if info.deadline > self.loop.time():  # kept alive since: sleep again
            info.timer = self.loop.call_at(info.deadline, self._on_deadline, lease)
            return
        # The store expires leases lazily, on its next operation: make one, so the
        # deletes happen (and watchers hear of them) now.
        self.store.get("")
        self._forget(lease)
        self.publish()

    def _on_grace_over(self, lease: int) -> None:
        info = self._leases.get(lease)
        if info is None or info.owner is not None:
            return
        log.info(
            "lease %d revoked: its connection dropped and was not resumed", self._lease_out(lease)
        )
        self.store.revoke_lease(lease)
        self._forget(lease)
        self.publish()

    def orphan(self, conn: Connection) -> None:
        """``conn`` is gone: its leases end after the grace unless resumed."""
        for lease in list(conn.leases):
            info = self._leases.get(lease)
            if info is None or info.owner is not conn:
                continue
            info.owner = None
            info.grace = self.loop.call_later(
                min(self._grace, info.ttl), self._on_grace_over, lease
            )
        conn.leases.clear()

    def resume(self, conn: Connection, wanted: list[int]) -> tuple[list[int], list[int]]:
        """Re-attach leases named in a hello to ``conn``; returns (resumed, lost)."""
        resumed, lost = [], []
        for wire in wanted:
            lease = self._lease_in(wire)
            info = self._leases.get(lease)
            if info is None or not self.store.keep_alive(lease):
                self._forget(lease)
                lost.append(wire)
                continue
            if info.owner is not None and info.owner is not conn:
                info.owner.leases.discard(lease)  # an old connection not yet seen closed
            if info.grace is not None:
                info.grace.cancel()
                info.grace = None
            info.owner = conn
            info.deadline = self.loop.time() + info.ttl
            conn.leases.add(lease)
            resumed.append(wire)
        self.publish()
        return resumed, lost

    # -- requests ------------------------------------------------------------------------

    def dispatch(self, conn: Connection, request: p.Message) -> None:
        """Answer one request: at once, or from a task for a blocking one."""
        rid = request.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise p.FrameError("a request without an integer id")
        op = str(request.get("op"))
        quick = self._quick.get(op)
        if quick is not None:
            try:
                frame = self._ok(rid, quick(conn, request))
            except StoreError as exc:
                frame = self._error(rid, exc)
            except Exception as exc:  # a server bug must not take down every client
                log.exception("internal error serving %s", op)
                frame = self._error(rid, StoreError(f"internal store error: {exc!r}"))
            self.publish()
            conn.send(frame)
            return
        blocking = self._blocking.get(op)
        if blocking is None:
            conn.send(self._error(rid, p.BadRequest(f"unknown operation {op[:40]!r}")))
            return
        task = self.loop.create_task(self._run_blocking(conn, rid, blocking, request))
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _run_blocking(
        self,
        conn: Connection,
        rid: int,
        call: Callable[[p.Message], Awaitable[object]],
        request: p.Message,
    ) -> None:
        try:
            frame = self._ok(rid, await call(request))
        except StoreError as exc:
            frame = self._error(rid, exc)
        except Exception as exc:  # a server bug must not take down every client
            log.exception("internal error serving %s", request.get("op"))
            frame = self._error(rid, StoreError(f"internal store error: {exc!r}"))
        conn.send(frame)

    def _ok(self, rid: int, result: object) -> bytes:
        if isinstance(result, WatchResult):
            return self._fit_watch(rid, result)
        try:
            return p.encode({"id": rid, "ok": True, "result": result}, self.max_frame)
        except p.FrameError as exc:
            return self._error(rid, StoreError(f"the answer is too large: {exc}"), p.CODE_TOO_LARGE)

    def _fit_watch(self, rid: int, result: WatchResult) -> bytes:
        # A watch may answer with the first part of the changes: the client resumes
        # from the last revision it got. Halve until the answer fits in a frame.
        events = result.events
        while True:
            try:
                return p.encode(
                    {"id": rid, "ok": True, "result": p.watch_to_wire(result)}, self.max_frame
                )
            except p.FrameError as exc:
                if len(events) <= 1:
                    error = StoreError(f"a single change is too large to send: {exc}")
                    return self._error(rid, error, p.CODE_TOO_LARGE)
            events = events[: len(events) // 2]
            result = WatchResult(events, events[-1].revision)

    def _error(self, rid: int, exc: StoreError, code: str | None = None) -> bytes:
        if code is None:
            code = p.CODE_BAD_REQUEST if isinstance(exc, p.BadRequest) else p.error_code(exc)
        reply = {"id": rid, "ok": False, "code": code, "message": str(exc)[:2000]}
        return p.encode(reply, max(self.max_frame, p.HANDSHAKE_MAX_FRAME))

    # -- quick operations ----------------------------------------------------------------

    def _get(self, conn: Connection, m: p.Message) -> object:
        return p.opt_b64(self.store.get(p.get_str(m, "key")))

    def _set(self, conn: Connection, m: p.Message) -> object:
        value = p.unb64(m.get("value"), "value")
        with self._lease_errors(m):
            revision = self.store.set(p.get_str(m, "key"), value, lease=self._opt_lease_in(m))
        return self._rev_out(revision)

    def _add(self, conn: Connection, m: p.Message) -> object:
        return self.store.add(p.get_str(m, "key"), p.get_int(m, "amount"))

    def _compare_set(self, conn: Connection, m: p.Message) -> object:
        expected = p.opt_unb64(m.get("expected"), "expected")
        value = p.unb64(m.get("value"), "value")
        with self._lease_errors(m):
            swapped, current = self.store.compare_set(
                p.get_str(m, "key"), expected, value, lease=self._opt_lease_in(m)
            )
        return [swapped, p.opt_b64(current)]

    def _delete(self, conn: Connection, m: p.Message) -> object:
        return self.store.delete(p.get_str(m, "key"))

    def _get_prefix(self, conn: Connection, m: p.Message) -> object:
        found, revision = self.store.get_prefix(p.get_str(m, "prefix"))
        items = {k: p.b64(v) for k, v in found.items()}
        return {"items": items, "revision": self._rev_out(revision)}

    def _grant_lease(self, conn: Connection, m: p.Message) -> object:
        ttl = p.get_float(m, "ttl")
        if not math.isfinite(ttl) or ttl <= 0:
            raise StoreError(f"a lease needs a positive, finite ttl, got {ttl}")
        lease = self.store.grant_lease(ttl)
        self._track(lease, ttl, conn)
        return self._lease_out(lease)

    def _keep_alive(self, conn: Connection, m: p.Message) -> object:
        lease = self._lease_in(p.get_int(m, "lease"))
        alive = self.store.keep_alive(lease)
        info = self._leases.get(lease)
        if not alive:
            self._forget(lease)
        elif info is not None:
            info.deadline = self.loop.time() + info.ttl  # its timer re-arms when it fires
        return alive

    def _revoke_lease(self, conn: Connection, m: p.Message) -> object:
        lease = self._lease_in(p.get_int(m, "lease"))
        self.store.revoke_lease(lease)
        self._forget(lease)
        return None

    # -- blocking operations -------------------------------------------------------------

    async def _watch(self, m: p.Message) -> object:
        prefix = p.get_str(m, "prefix")
        wire_after = p.get_int(m, "after")
        after = self._rev_in(wire_after)
        deadline = self.loop.time() + p.get_timeout(m, "timeout")
        while True:
            try:
                # After an empty look, only changes newer than it can match: start
                # there, so a wake-up costs the new changes, not the whole backlog.
                result = self.store.watch(prefix, after, 0)
            except StoreCompactedError:
                raise StoreCompactedError(
                    f"changes after revision {wire_after} are no longer kept; re-read and resume"
                ) from None
            finally:
                self.publish()
            if result.events or self.loop.time() >= deadline:
                events = tuple(self._event_out(e) for e in result.events)
                return WatchResult(events, self._rev_out(result.revision))
            after = result.revision
            await self._until_change(deadline, prefix=prefix)

    async def _wait(self, m: p.Message) -> object:
        keys = p.get_str_list(m, "keys")
        timeout = p.get_timeout(m, "timeout")
        deadline = self.loop.time() + timeout
        while True:
            missing = {k for k in keys if self.store.get(k) is None}
            self.publish()
            if not missing:
                return None
            if self.loop.time() >= deadline:
                raise StoreTimeoutError(
                    f"timed out after {timeout:.3g}s waiting for {sorted(missing)}"
                )
            await self._until_change(deadline, keys=missing)

    # -- handshake -----------------------------------------------------------------------

    def challenge(self, nonce: bytes) -> bytes:
        return p.encode(
            {
                "type": "challenge",
                "version": p.PROTOCOL_VERSION,
                "nonce": p.b64(nonce),
                "auth": self.token is not None,
                "max_frame": self.max_frame,
            },
            p.HANDSHAKE_MAX_FRAME,
        )

    def hello(self, conn: Connection, hello: p.Message, nonce: bytes) -> bool:
        """Check a client's hello and answer it; False when the client was refused."""
        if hello.get("type") != "hello":
            raise p.FrameError(f"expected a hello, got {str(hello.get('type'))[:40]!r}")
        version = str(hello.get("version"))[:20]
        if hello.get("version") != p.PROTOCOL_VERSION:
            self.limiter.log(
                logging.WARNING,
                "version",
                "refused %s: it speaks protocol version %s",
                conn.peer,
                version,
            )
            message = (
                f"the store speaks protocol version {p.PROTOCOL_VERSION}, the client {version}"
            )
            conn.send(self._refusal(p.CODE_VERSION, message))
            return False
        if self.token is not None and not p.check_proof(self.token, nonce, hello.get("proof")):
            self.limiter.log(
                logging.WARNING,
                "auth",
                "refused %s: authentication failed (wrong or missing token)",
                conn.peer,
            )
            conn.send(self._refusal(p.CODE_AUTH, "authentication failed"))
            return False
        try:
            wanted = p.get_int_list(hello, "resume")
        except p.BadRequest as exc:
            raise p.FrameError(f"bad hello: {exc}") from None
        resumed, lost = self.resume(conn, wanted)
        if wanted:
            log.info("%s resumed leases %s (lost: %s)", conn.peer, resumed, lost)
        welcome = {
            "type": "welcome",
            "version": p.PROTOCOL_VERSION,
            "resumed": resumed,
            "lost": lost,
        }
        conn.send(p.encode(welcome, max(self.max_frame, p.HANDSHAKE_MAX_FRAME)))
        return True

    def _refusal(self, code: str, message: str) -> bytes:
        return p.encode({"type": "error", "code": code, "message": message}, p.HANDSHAKE_MAX_FRAME)

    def room(self) -> None:
        """A connection ended or authenticated: tell the acceptor."""
        if self.on_room is not None:
            self.on_room()


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
        peer = transport.get_extra_info("peername")
        self.peer = format_addr(str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                p.tune_socket(sock)
            except OSError as exc:  # the peer may already be gone; the read will tell
                log.debug("socket options for %s: %r", self.peer, exc)
        service = self._service
        service.conns.add(self)
        service.handshaking[self] = service.loop.time()
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
        service.orphan(self)
        log.debug("connection from %s closed (%r)", self.peer, exc)
        service.room()
