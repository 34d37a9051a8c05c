"""The tcp store client: a thread-safe, synchronous ``Store`` over one connection.

Several threads of an agent (heartbeat, watcher, main loop) share one client, and a
watch blocked for seconds must not hold up a keep-alive. Requests therefore carry ids
and are multiplexed over a single connection: callers send under a lock and wait on
their own event, and one reader thread per connection hands each answer to its caller.
(One connection per in-flight call was the alternative; it multiplies descriptors on a
server meant for thousands of agents, and ties leases to whichever socket granted them.)

A request cut off mid-flight by a dropped connection is retried only when repeating it
is harmless; otherwise the caller gets a ``StoreError`` saying the outcome is unknown.

Giving up is one deadline per outage, not one per call: the client notes when the
server stopped answering (the connection dropped, a dial failed, or a request went
unanswered for ``request_timeout``) and every caller waits for the same reconnection,
until ``connect_timeout`` after that moment. Callers queued behind a dial that failed
share its outcome instead of dialling again one after the other, so a dead server costs
``max(connect_timeout, request_timeout)`` in all however many threads were waiting
(the alternative, each call with a window of its own, stacked up to several windows
in a caller that makes a few calls in a row). After the deadline a call makes one short
attempt of its own -- a server that came back is found -- and otherwise fails at once
with ``StoreUnavailableError``.

A call in a cancel scope with a deadline (``store.api``) ends by it with
``StoreTimeoutError``, wherever it waits: for the dialer, a connection, the backoff or
the answer. Giving up at a deadline leaves a healthy connection alone: the request
stays owed, its late answer is dropped, and only when some owed answer is
``request_timeout`` overdue is the server taken as silent -- by whichever call notices,
so that callers with short deadlines (a keep-alive bounded by its interval) still find
a partitioned server out. A window that ran out is reported even past a deadline.

One connection, its reader thread and its handshake are in :mod:`.link`; keeping it up
across outages (dialling, backoff, the outage window, the leases to resume) is the
:class:`~elastrun.store.tcp.dialer.Dialer`'s; this module has the requests and the
store model.
"""

from __future__ import annotations

import itertools
import math
import time

from elastrun.core.cancel import Cancelled, CancelScope, is_default, scope_or_default
from elastrun.core.errors import ConfigError, StoreError, StoreUnavailableError
from elastrun.store.api import WatchResult, check_lease_ttl
from elastrun.store.tcp import protocol as p
from elastrun.store.tcp.dialer import Dialer, past_deadline
from elastrun.store.tcp.link import Connection, NotSent, Pending

#: How often a call cut off by a dropped connection is re-sent (when that is harmless).
_RETRIES = 3


class TcpStore:
    """A client of ``TcpStoreServer``; implements the ``Store`` protocol.

    Args:
        host, port: where the server listens.
        token: the shared secret when the server requires one.
        connect_timeout: how long to keep trying (with backoff) to reach the server,
            counted from the moment it stopped answering (or from the first attempt),
            before giving up with ``StoreUnavailableError``; one window per outage,
            shared by every call.
        request_timeout: how long to wait for an answer to a request (beyond the
            timeout of a ``watch`` or ``wait``) before giving the connection up; the
            outage then counts from when that request was sent.

    Connects lazily on first use (or on :meth:`connect`); the constructor only
    validates its arguments (``ConfigError``). Thread-safe. Errors:
    ``StoreAuthError`` when the server refuses the token, ``StoreUnavailableError`` when
    it cannot be reached or stopped answering, ``StoreError`` when a write's outcome is
    unknown after a connection loss, and the
    model's errors (``LeaseExpiredError``, ``StoreTimeoutError``,
    ``StoreCompactedError``) as the server reports them.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        connect_timeout: float = 10.0,
        request_timeout: float = 30.0,
    ) -> None:
        if not 0 < port <= 65535:
            raise ConfigError("port", port, "must be in 1..65535")
        if connect_timeout < 0:
            raise ConfigError("connect_timeout", connect_timeout, "must be >= 0")
        if not request_timeout > 0:
            raise ConfigError("request_timeout", request_timeout, "must be > 0")
        self._where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._request_timeout = request_timeout
        self._ids = itertools.count(1)
        self._dialer = Dialer(host, port, self._where, token, connect_timeout)

    # -- connection management -----------------------------------------------------------

    def connect(self) -> None:
        """Connect now instead of on first use.

        Raises ``StoreError`` (``StoreAuthError`` for a refused token).
        """
        try:
            self._dialer.connection(self._dialer.life)
        except Cancelled:
            raise self._dialer.closed_error() from None

    # -- requests ------------------------------------------------------------------------

    def _call(
        self,
        op: str,
        args: p.Message,
        *,
        retry: bool,
        what: str,
        wait_until: float | None = None,
        scope: CancelScope | None = None,
    ) -> object:
        """Send one request and return its result.

        ``retry``: whether re-sending after a connection loss is harmless.
        ``wait_until``: monotonic deadline of a blocking call (``watch``/``wait``);
        each attempt sends the time left as its timeout.
        ``scope`` (default: the thread's current scope): cancelling it ends the call at
        once with ``Cancelled`` (while it connects, queues for the connection, or waits
        for the answer); its deadline ends it with ``StoreTimeoutError``.
        """
        outer = scope_or_default(scope)
        try:
            if is_default(outer):
                return self._request(op, args, retry, what, wait_until, self._dialer.life)
            with (
                CancelScope(deadline=outer.deadline, parent=self._dialer.life) as both,
                outer.wakes(lambda: both.cancel(outer.reason or "")),
            ):
                try:
                    return self._request(op, args, retry, what, wait_until, both)
                except Cancelled:
                    if outer.cancelled:
                        raise Cancelled(outer.reason or "cancelled") from None
                    raise
        except Cancelled:
            if self._dialer.closed:  # ``close`` cancelled the call
                raise self._dialer.closed_error(what) from None
            raise

    def _request(
        self,
        op: str,
        args: p.Message,
        retry: bool,
        what: str,
        wait_until: float | None,
        scope: CancelScope,
    ) -> object:
        attempts = 0
        while True:
            if self._dialer.closed:
                raise self._dialer.closed_error(what)
            scope.raise_if_cancelled()
            if scope.expired():
                raise past_deadline(what, self._where, unknown=False)
            conn = self._dialer.connection(scope)
            patience = self._request_timeout
            server_wait = 0.0
            if wait_until is not None:
                # The server ends the wait by the caller's deadline too: it holds no
                # waiter for a call nobody waits for any more.
                server_wait = scope.remaining(max(0.0, wait_until - time.monotonic()))
                args["timeout"] = p.put_timeout(server_wait)
                patience = server_wait + self._request_timeout
            rid = next(self._ids)
            try:
                frame = p.encode({"id": rid, "op": op, **args}, conn.max_frame)
            except p.FrameError as exc:
                raise StoreError(f"{what}: {exc}") from None
            try:
                pending = conn.send(rid, frame, due=time.monotonic() + server_wait)
            except NotSent:
                pass  # sending it again is always safe
            else:
                self._await(conn, rid, pending, patience, retry, what, scope)
                if not pending.lost:
                    answer = pending.answer or {}
                    if answer.get("ok") is True:
                        return answer.get("result")
                    raise p.error_from_code(answer.get("code"), str(answer.get("message")))
                if self._dialer.closed:
                    raise StoreError(f"{what}: the client was closed")
                if not retry:
                    raise StoreError(
                        f"{what}: the connection to the store at {self._where} was lost "
                        "before the answer came; it may or may not have been applied"
                    )
            attempts += 1
            if attempts > _RETRIES:
                raise StoreError(
                    f"{what}: the connection to the store at {self._where} keeps dropping"
                )

    def _await(
        self,
        conn: Connection,
        rid: int,
        pending: Pending,
        patience: float,
        retry: bool,
        what: str,
        scope: CancelScope,
    ) -> None:
        """Wait for ``pending`` to be answered or lost; raise ``Cancelled`` when ``scope``
        is, ``StoreTimeoutError`` at its deadline, and ``StoreUnavailableError`` (cutting
        the connection) once an answer the server owes on it -- this one after
        ``patience``, or another caller's -- is ``request_timeout`` overdue."""
        with scope.wakes(pending.interrupt):
            while True:
                overdue = conn.overdue_since()
                silent_at = math.inf if overdue is None else overdue + self._request_timeout
                # Looked at again at least every half request timeout: answers that other
                # callers stopped waiting for become owed while this call waits (a long
                # watch notices a silence that the keep-alives' deadlines cut short).
                wait = min(
                    silent_at - time.monotonic(), scope.remaining(), self._request_timeout / 2
                )
                if pending.wait(max(0.0, wait)):
                    break
                now = time.monotonic()
                if scope.expired() or (now >= silent_at and overdue == conn.overdue_since()):
                    break  # else the owed answer came meanwhile, or a slice ended: wait on
        if pending.answer is not None or pending.lost:
            return
        if scope.cancelled:
            conn.forget(rid)
            raise Cancelled(scope.reason or "cancelled")
        overdue = conn.overdue_since()
        now = time.monotonic()
        if overdue is None or now - overdue < self._request_timeout:
            # The caller's deadline, not the server's silence: the request stays owed
            # (the reader drops its late answer).
            raise past_deadline(what, self._where, unknown=not retry)
        if overdue >= pending.due:
            message = f"did not answer within {patience:.1f}s"
        else:
            message = f"has not answered for {now - overdue:.1f}s"
        raise self._silent(conn, overdue, f"{what}: the store at {self._where} {message}", retry)

    def _silent(
        self, conn: Connection, since: float, message: str, retry: bool
    ) -> StoreUnavailableError:
        """The server owes an answer that was due at ``since``, ``request_timeout`` ago or
        more: the outage (every caller's reconnect window) counts from then, and the
        connection is given up."""
        self._dialer.went_silent(conn, since)
        conn.abort()
        return StoreUnavailableError(
            message + ("" if retry else "; it may or may not have been applied"),
            address=self._where,
            silent_for=time.monotonic() - since,
        )

    # -- the store model -----------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        result = self._call("get", {"key": key}, retry=True, what=f"get({key!r})")
        return p.opt_unb64(result, "result")

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        # Writing the same value again is harmless; re-binding a lease after a reconnect
        # is not (the lease may have gone in between).
        result = self._call(
            "set",
            {"key": key, "value": p.b64(bytes(value)), "lease": lease},
            retry=lease is None,
            what=f"set({key!r})",
        )
        return _int(result)

    def add(self, key: str, amount: int) -> int:
        result = self._call(
            "add", {"key": key, "amount": amount}, retry=False, what=f"add({key!r}, {amount})"
        )
        return _int(result)

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        args: p.Message = {
            "key": key,
            "expected": p.opt_b64(None if expected is None else bytes(expected)),
            "value": p.b64(bytes(value)),
            "lease": lease,
        }
        result = self._call("compare_set", args, retry=False, what=f"compare_set({key!r})")
        if not isinstance(result, list) or len(result) != 2 or not isinstance(result[0], bool):
            raise StoreError(f"compare_set({key!r}): malformed answer from {self._where}")
        return result[0], p.opt_unb64(result[1], "current")

    def delete(self, key: str) -> bool:
        result = self._call("delete", {"key": key}, retry=False, what=f"delete({key!r})")
        return bool(result)

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        result = self._call(
            "get_prefix", {"prefix": prefix}, retry=True, what=f"get_prefix({prefix!r})"
        )
        items = result.get("items") if isinstance(result, dict) else None
        if not isinstance(result, dict) or not isinstance(items, dict):
            raise StoreError(f"get_prefix({prefix!r}): malformed answer from {self._where}")
        found = {str(k): p.unb64(v, "value") for k, v in items.items()}
        return found, p.get_int(result, "revision")

    def grant_lease(self, ttl: float) -> int:
        check_lease_ttl(ttl)
        # Retrying is harmless: a lease granted on a connection that then dropped is
        # orphaned, never resumed (we never learnt its id), and revoked after the grace.
        lease = _int(
            self._call("grant_lease", {"ttl": ttl}, retry=True, what=f"grant_lease({ttl})")
        )
        self._dialer.hold(lease)
        return lease

    def keep_alive(self, lease: int) -> bool:
        alive = bool(
            self._call("keep_alive", {"lease": lease}, retry=True, what=f"keep_alive({lease})")
        )
        if not alive:
            self._dialer.release(lease)
        return alive

    def revoke_lease(self, lease: int) -> None:
        self._dialer.release(lease)  # first: a reconnect must not resume it
        self._call("revoke_lease", {"lease": lease}, retry=True, what=f"revoke_lease({lease})")

    def watch(
        self,
        prefix: str,
        after_revision: int,
        timeout: float,
        *,
        scope: CancelScope | None = None,
    ) -> WatchResult:
        until = time.monotonic() + timeout if timeout != math.inf else math.inf
        live = scope_or_default(scope)
        what = f"watch({prefix!r})"
        result = p.watch_from_wire(
            self._call(
                "watch",
                {"prefix": prefix, "after": after_revision},
                retry=True,
                what=what,
                wait_until=until,
                scope=live,
            )
        )
        if not result.events and live.expired() and time.monotonic() < until:
            # The server ended the wait at the caller's deadline, a moment before this
            # client did: a deadline ends a watch with an error (``store.api``).
            raise past_deadline(what, self._where, unknown=False)
        return result

    def wait(self, keys: list[str], timeout: float, *, scope: CancelScope | None = None) -> None:
        until = time.monotonic() + timeout if timeout != math.inf else math.inf
        self._call(
            "wait",
            {"keys": list(keys)},
            retry=True,
            what=f"wait({keys!r})",
            wait_until=until,
            scope=scope,
        )

    def close(self) -> None:
        """Drop the connection; idempotent.

        The server revokes this client's leases after its grace period (at most their
        TTL), so its keys vanish shortly after.
        """
        self._dialer.close()

    def __enter__(self) -> TcpStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpStore({self._where}, {self._dialer.state}, leases={self._dialer.leases()})"


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StoreError(f"the store answered {value!r} where a number was expected")
    return value
