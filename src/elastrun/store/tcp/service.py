"""The server side of the tcp store: one ``MemoryStore`` served to many connections.

Everything here runs on the server's event loop and only there. The loop owns the
store: each request is a short, non-blocking call on it (its lock is never contended,
so no call can stall the loop). Connections (:mod:`~elastrun.store.tcp.connection`)
are ``asyncio.Protocol`` objects: a request that can be answered at once is answered
inside ``data_received``, with no task and no extra loop iteration. Only ``watch`` and
``wait`` become tasks.

Waiting is event-driven: a change wakes only the waiters it concerns
(:mod:`~elastrun.store.tcp.waiters`).
Leases belong to the connection that granted them and outlive a dropped one by a short
grace (:mod:`~elastrun.store.tcp.leases`); revisions and lease ids travel offset by the
server's start (:mod:`~elastrun.store.tcp.numbering`).

A stranger can open connections and say nothing: each one not authenticated within
``HANDSHAKE_TIMEOUT`` is closed, the acceptor (``acceptor``) caps how many may be
pending at once, and what they cause is logged through a ``LogLimiter`` -- a line per
kind every few seconds, never a line per connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from elastrun.core.errors import (
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import WatchEvent, WatchResult
from elastrun.store.memory import MemoryStore
from elastrun.store.tcp import protocol as p
from elastrun.store.tcp.acceptor import Admissions
from elastrun.store.tcp.connection import HANDSHAKE_TIMEOUT, Connection, format_addr
from elastrun.store.tcp.leases import LeaseTable
from elastrun.store.tcp.limits import LogLimiter
from elastrun.store.tcp.numbering import Numbering
from elastrun.store.tcp.waiters import Waiters, Woken

__all__ = ["HANDSHAKE_TIMEOUT", "LOG_EVERY", "Connection", "Service", "format_addr"]

log = logging.getLogger("elastrun.store.tcp.server")

#: Lines a stranger can cause once per connection: at most one per kind this often.
LOG_EVERY = 10.0

#: How many shared watch answers (``_Shared``) are kept for the watchers still to wake.
SHARED_KEPT = 8


@dataclass(slots=True, eq=False)
class _Shared:
    """A watch answer shared by every watcher that one change woke under one prefix: its
    result, encoded once. When a member of 10,000 is lost, 10,000 watchers of the run's
    ``ctl/`` wake with the same event; encoding it for each one was most of the server's
    work for that notice."""

    result: WatchResult
    body: bytes


class Service(Admissions[Connection]):
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
        super().__init__(loop, functools.partial(Connection, self))
        self._num = Numbering(base)
        self.store = store
        self.token = token
        self.max_frame = max_frame
        self._seen = store.revision
        self._waiters = Waiters()
        # The latest shared answers, by the identity of the events that woke their
        # watchers (the tuple is kept with it, so its identity cannot be reused).
        self._shared: dict[int, tuple[Woken, _Shared]] = {}
        #: The connections' leases: a dropped one's end after the grace unless resumed.
        self.leases = LeaseTable(loop, store, grace, self._num, self.publish)
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

    def __repr__(self) -> str:
        return (
            f"Service(connections={len(self.conns)}, leases={len(self.leases)}, "
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
    ) -> Woken:
        """Wait until a change under ``prefix`` or the creation of one of ``keys``;
        returns the events under ``prefix`` that came (None: look for yourself)."""
        fut: asyncio.Future[Woken] = self.loop.create_future()
        w = self._waiters
        wanted = [(w.by_prefix, prefix)] if prefix is not None else []
        wanted += [(w.by_key, k) for k in keys]
        for index, what in wanted:
            w.add(index, what, fut)
        try:
            async with asyncio.timeout_at(None if math.isinf(deadline) else deadline):
                return await fut
        except TimeoutError:
            return None  # the caller looks at the clock and answers "nothing yet"
        finally:
            for index, what in wanted:
                w.remove(index, what, fut)

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
            except Exception as exc:
                frame = self._failed(rid, op, exc)
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
        except Exception as exc:
            frame = self._failed(rid, request.get("op"), exc)
        conn.send(frame)

    def _failed(self, rid: int, op: object, exc: Exception) -> bytes:
        """The error answer to a request that raised ``exc`` (in its except clause)."""
        if not isinstance(exc, StoreError):  # a server bug must not take down every client
            log.exception("internal error serving %s", op)
            exc = StoreError(f"internal store error: {exc!r}")
        return self._error(rid, exc)

    def _ok(self, rid: int, result: object) -> bytes:
        if isinstance(result, _Shared):
            try:
                return p.encode_ok(rid, result.body, self.max_frame)
            except p.FrameError:
                return self._fit_watch(rid, result.result)
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
        with self._num.lease_errors(m):
            revision = self.store.set(p.get_str(m, "key"), value, lease=self._num.opt_lease_in(m))
        return self._num.rev_out(revision)

    def _add(self, conn: Connection, m: p.Message) -> object:
        return self.store.add(p.get_str(m, "key"), p.get_int(m, "amount"))

    def _compare_set(self, conn: Connection, m: p.Message) -> object:
        expected = p.opt_unb64(m.get("expected"), "expected")
        value = p.unb64(m.get("value"), "value")
        with self._num.lease_errors(m):
            swapped, current = self.store.compare_set(
                p.get_str(m, "key"), expected, value, lease=self._num.opt_lease_in(m)
            )
        return [swapped, p.opt_b64(current)]

    def _delete(self, conn: Connection, m: p.Message) -> object:
        return self.store.delete(p.get_str(m, "key"))

    def _get_prefix(self, conn: Connection, m: p.Message) -> object:
        found, revision = self.store.get_prefix(p.get_str(m, "prefix"))
        items = {k: p.b64(v) for k, v in found.items()}
        return {"items": items, "revision": self._num.rev_out(revision)}

    def _grant_lease(self, conn: Connection, m: p.Message) -> object:
        ttl = p.get_float(m, "ttl")
        lease = self.store.grant_lease(ttl)  # (the store checks the ttl: check_lease_ttl)
        self.leases.track(lease, ttl, conn)
        return self._num.lease_out(lease)

    def _keep_alive(self, conn: Connection, m: p.Message) -> object:
        lease = self._num.lease_in(p.get_int(m, "lease"))
        alive = self.store.keep_alive(lease)
        self.leases.kept_alive(lease, alive)
        return alive

    def _revoke_lease(self, conn: Connection, m: p.Message) -> object:
        lease = self._num.lease_in(p.get_int(m, "lease"))
        self.store.revoke_lease(lease)
        self.leases.forget(lease)
        return None

    # -- blocking operations -------------------------------------------------------------

    async def _watch(self, m: p.Message) -> object:
        prefix = p.get_str(m, "prefix")
        wire_after = p.get_int(m, "after")
        after = self._num.rev_in(wire_after)
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
                events = tuple(self._num.event_out(e) for e in result.events)
                return WatchResult(events, self._num.rev_out(result.revision))
            after = result.revision
            woken = await self._until_change(deadline, prefix=prefix)
            if woken:  # every change under the prefix after ``after``, up to these
                return self._shared_answer(woken)

    def _shared_answer(self, woken: tuple[WatchEvent, ...]) -> _Shared:
        """The answer for watchers woken by ``woken``, made once for all of them."""
        kept = self._shared.get(id(woken))
        if kept is not None and kept[0] is woken:
            return kept[1]
        events = tuple(self._num.event_out(e) for e in woken)
        result = WatchResult(events, self._num.rev_out(woken[-1].revision))
        shared = _Shared(result, p.encode_json(p.watch_to_wire(result)))
        if len(self._shared) >= SHARED_KEPT:
            del self._shared[next(iter(self._shared))]
        self._shared[id(woken)] = (woken, shared)
        return shared

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
        resumed, lost = self.leases.resume(conn, wanted)
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
