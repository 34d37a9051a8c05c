"""The tcp store client: a thread-safe, synchronous ``Store`` over one connection.

Several threads of an agent (heartbeat, watcher, main loop) share one client, and a
watch blocked for seconds must not hold up a keep-alive. Requests therefore carry ids
and are multiplexed over a single connection: callers send under a lock and wait on
their own event, and one reader thread per connection hands each answer to its caller.
(One connection per in-flight call was the alternative; it multiplies descriptors on a
server meant for thousands of agents, and ties leases to whichever socket granted them.)

When the connection drops, the next call -- or at once, in the background, when this
client holds leases -- reconnects with exponential backoff and jitter, naming its leases
in the hello so that the server re-attaches them. A request cut off mid-flight is
retried only when repeating it is harmless; otherwise the caller gets a ``StoreError``
saying the outcome is unknown.

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
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable

from elastrun.core.cancel import Cancelled, CancelScope, is_default, scope_or_default
from elastrun.core.errors import ConfigError, StoreAuthError, StoreError, StoreUnavailableError
from elastrun.store.api import WatchResult
from elastrun.store.tcp import protocol as p

log = logging.getLogger(__name__)

_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 1.0
#: How often a call cut off by a dropped connection is re-sent (when that is harmless).
_RETRIES = 3
_JOIN_TIMEOUT = 5.0
#: Longest single connection attempt (handshake included); the dialer then retries.
_ATTEMPT_CAP = 5.0
#: Shortest one: the last attempt of a window, or a call's one attempt after it, gets
#: this long for the connection and the handshake even when less of the window is left.
_ATTEMPT_MIN = 0.5


class _Pending:
    """One request waiting for its answer."""

    __slots__ = ("_done", "answer", "lost")

    # ``interrupt`` wakes the waiter with neither an answer nor a loss: its scope was
    # cancelled (the caller stops waiting; a late answer is dropped).

    def __init__(self) -> None:
        self._done = threading.Event()
        self.answer: p.Message | None = None
        self.lost = False

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


class _NotSent(Exception):
    """The request never fully left this process: sending it again is always safe."""


class _Connection:
    """One authenticated socket, its reader thread and the requests awaiting answers."""

    def __init__(
        self,
        sock: socket.socket,
        buf: bytearray,
        max_frame: int,
        label: str,
        on_lost: Callable[[_Connection], None],
    ) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._buf = buf
        self._on_lost = on_lost
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()  # guards _pending, alive, and closing the socket
        self._send_lock = threading.Lock()  # one frame at a time on the wire
        self.alive = True
        self.thread = threading.Thread(
            target=self._read_loop, name=f"elastrun-store-client {label}", daemon=True
        )

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed"
        return f"_Connection({state}, pending={len(self._pending)})"

    def send(self, rid: int, frame: bytes) -> _Pending:
        pending = _Pending()
        with self._lock:
            if not self.alive:
                raise _NotSent
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
            raise _NotSent from None
        return pending

    def forget(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def abort(self) -> None:
        """Cut the connection; the reader thread notices, fails pending calls, cleans up."""
        with self._lock:
            if self.alive:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def _read_loop(self) -> None:
        try:
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
        self._host = host
        self._port = port
        self._where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._token = token
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _conn, _leases, _threads, _dialing
        self._dialer = threading.Condition()  # one dialer at a time (``_dial_busy``)
        self._dial_busy = False
        self._life = CancelScope()  # cancelled by ``close``: ends every wait
        self._conn: _Connection | None = None
        self._leases: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._dialing: socket.socket | None = None
        self._closed = threading.Event()
        # The outage: when the server stopped answering (None while connected), whether
        # it ever answered, and the end of the last window that ran out: (when, message).
        self._down_since: float | None = None
        self._ever_connected = False
        self._failed: tuple[float, str] | None = None

    # -- connection management -----------------------------------------------------------

    def connect(self) -> None:
        """Connect now instead of on first use.

        Raises ``StoreError`` (``StoreAuthError`` for a refused token).
        """
        try:
            self._connection(self._life)
        except Cancelled:
            raise StoreError(f"the client of the store at {self._where} is closed") from None

    def _connection(self, scope: CancelScope) -> _Connection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        asked = time.monotonic()
        self._take_dialer(scope)
        try:
            if self._closed.is_set():
                raise StoreError(f"the client of the store at {self._where} is closed")
            conn = self._conn
            if conn is not None and conn.alive:
                return conn
            with self._lock:
                failed = self._failed
            if failed is not None and failed[0] >= asked:
                # A window ran out while this call queued for the dialer: its outcome is
                # this call's too (N queued calls must not each try again in turn).
                raise self._unavailable(failed[1])
            conn = self._dial(scope)
            with self._lock:
                if self._closed.is_set():
                    conn.sock.close()
                    raise StoreError(f"the client of the store at {self._where} is closed")
                self._conn = conn
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(conn.thread)
            conn.thread.start()
            return conn
        finally:
            with self._dialer:
                self._dial_busy = False
                self._dialer.notify_all()

    def _take_dialer(self, scope: CancelScope) -> None:
        """Become the one dialer; a cancelled scope stops queueing behind another."""

        def wake() -> None:
            with self._dialer:
                self._dialer.notify_all()

        with self._dialer, scope.wakes(wake):
            while self._dial_busy:
                scope.raise_if_cancelled()
                self._dialer.wait()
            scope.raise_if_cancelled()
            self._dial_busy = True

    def _dial(self, scope: CancelScope) -> _Connection:
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
            deadline = self._down_since + self._connect_timeout
        delay = _BACKOFF_FIRST
        while True:
            try:
                attempt = max(_ATTEMPT_MIN, min(_ATTEMPT_CAP, deadline - time.monotonic()))
                conn = self._open(attempt, scope)
            except StoreAuthError:
                raise  # retrying cannot fix a wrong token
            except _Refused as exc:
                raise StoreError(str(exc)) from None
            except (OSError, p.FrameError, p.BadRequest) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                if self._closed.is_set():
                    raise StoreError(f"the client of the store at {self._where} is closed") from exc
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._give_up(reason) from exc
            else:
                with self._lock:
                    self._down_since = self._failed = None
                    self._ever_connected = True
                return conn
            # Full jitter keeps a thousand agents that lost the server together from
            # coming back in lockstep.
            scope.sleep(min(left, random.uniform(delay / 2, delay)))
            delay = min(_BACKOFF_CAP, delay * 2)

    def _give_up(self, reason: str) -> StoreUnavailableError:
        """The window ran out: remember its outcome for the calls queued behind it."""
        now = time.monotonic()
        with self._lock:
            message = f"cannot reach the store at {self._where}: {reason}"
            if self._ever_connected:
                since = self._down_since if self._down_since is not None else now
                message += f"; it has not answered for {now - since:.0f}s"
            self._failed = (now, message)
        return self._unavailable(message)

    def _unavailable(self, message: str) -> StoreUnavailableError:
        with self._lock:
            since = self._down_since
        silent = time.monotonic() - since if since is not None else 0.0
        return StoreUnavailableError(message, address=self._where, silent_for=silent)

    def _open(self, timeout: float, scope: CancelScope) -> _Connection:
        # Short attempts; the connect itself ends at once when the scope is cancelled.
        sock = _connect((self._host, self._port), timeout, scope)
        with self._lock:
            self._dialing = sock
        try:
            p.tune_socket(sock)
            buf = bytearray()
            challenge = p.recv_frame(sock, p.HANDSHAKE_MAX_FRAME, buf)
            if challenge.get("type") != "challenge":
                raise p.FrameError(f"the server at {self._where} did not send a challenge")
            if challenge.get("version") != p.PROTOCOL_VERSION:
                raise _Refused(
                    f"the store at {self._where} speaks protocol version "
                    f"{challenge.get('version')}, this client {p.PROTOCOL_VERSION}"
                )
            nonce = p.unb64(challenge.get("nonce"), "nonce")
            max_frame = p.get_int(challenge, "max_frame")
            proof = None
            if challenge.get("auth") is True and self._token is not None:
                proof = p.proof(self._token, nonce)
            with self._lock:
                resume = sorted(self._leases)
            hello = {
                "type": "hello",
                "version": p.PROTOCOL_VERSION,
                "proof": proof,
                "resume": resume,
            }
            sock.sendall(p.encode(hello, p.HANDSHAKE_MAX_FRAME))
            reply = p.recv_frame(sock, max(max_frame, p.HANDSHAKE_MAX_FRAME), buf)
            if reply.get("type") == "error":
                if reply.get("code") == p.CODE_AUTH:
                    raise StoreAuthError(
                        f"store at {self._where} refused authentication: wrong or missing token"
                    )
                raise _Refused(f"the store at {self._where} refused: {reply.get('message')}")
            if reply.get("type") != "welcome":
                raise p.FrameError(f"the server at {self._where} did not welcome us")
            lost = p.get_int_list(reply, "lost")
            if lost:
                log.warning("store at %s: leases %s expired while reconnecting", self._where, lost)
                with self._lock:
                    self._leases.difference_update(lost)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        finally:
            with self._lock:
                self._dialing = None
        return _Connection(sock, buf, max_frame, self._where, self._on_lost)

    def _on_lost(self, conn: _Connection) -> None:
        # Runs on the dead connection's reader thread. Leases must be resumed within the
        # server's grace period, which an idle client would miss: reconnect right away.
        with self._lock:
            eager = bool(self._leases) and not self._closed.is_set() and self._conn is conn
        if not eager:
            return
        try:
            self._connection(self._life)
        except Cancelled:
            return  # closed meanwhile
        except StoreError as exc:
            # Debug only: every caller waiting meanwhile gets this very outcome, and
            # says it in its own terms (the rendezvous: one line naming the store).
            log.debug(
                "lost the connection to the store at %s and could not reconnect; "
                "its leases will expire: %s",
                self._where,
                exc,
            )

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
        for the answer).
        """
        scope = scope_or_default(scope)
        if is_default(scope):
            return self._attempt(op, args, retry, what, wait_until, self._life)
        outer = scope
        with self._life.child() as both, outer.wakes(lambda: both.cancel(outer.reason or "")):
            try:
                return self._attempt(op, args, retry, what, wait_until, both)
            except Cancelled:
                if outer.cancelled:
                    raise Cancelled(outer.reason or "cancelled") from None
                raise

    def _attempt(
        self,
        op: str,
        args: p.Message,
        retry: bool,
        what: str,
        wait_until: float | None,
        scope: CancelScope,
    ) -> object:
        try:
            return self._request(op, args, retry, what, wait_until, scope)
        except Cancelled:
            if self._closed.is_set():
                raise StoreError(
                    f"{what}: the client of the store at {self._where} is closed"
                ) from None
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
            if self._closed.is_set():
                raise StoreError(f"{what}: the client of the store at {self._where} is closed")
            conn = self._connection(scope)
            patience = self._request_timeout
            if wait_until is not None:
                left = max(0.0, wait_until - time.monotonic())
                args["timeout"] = p.put_timeout(left)
                patience = math.inf if math.isinf(left) else left + self._request_timeout
            rid = next(self._ids)
            try:
                frame = p.encode({"id": rid, "op": op, **args}, conn.max_frame)
            except p.FrameError as exc:
                raise StoreError(f"{what}: {exc}") from None
            sent_at = time.monotonic()
            try:
                pending = conn.send(rid, frame)
            except _NotSent:
                attempts += 1
                if attempts > _RETRIES:
                    raise StoreError(
                        f"{what}: the connection to the store at {self._where} keeps dropping"
                    ) from None
                continue
            with scope.wakes(pending.interrupt):
                pending.wait(None if patience > threading.TIMEOUT_MAX else patience)
            if pending.answer is None and not pending.lost and scope.cancelled:
                conn.forget(rid)
                raise Cancelled(scope.reason or "cancelled")
            if pending.answer is None and not pending.lost:
                conn.forget(rid)
                with self._lock:
                    # The server has been silent since this request left: the outage
                    # (and every caller's reconnect window) counts from then.
                    if self._conn is conn and self._down_since is None:
                        self._down_since = sent_at
                conn.abort()
                raise StoreUnavailableError(
                    f"{what}: the store at {self._where} did not answer within "
                    f"{patience:.1f}s" + ("" if retry else "; it may or may not have been applied"),
                    address=self._where,
                    silent_for=time.monotonic() - sent_at,
                )
            if pending.lost:
                attempts += 1
                if self._closed.is_set():
                    raise StoreError(f"{what}: the client was closed")
                if not retry:
                    raise StoreError(
                        f"{what}: the connection to the store at {self._where} was lost "
                        "before the answer came; it may or may not have been applied"
                    )
                if attempts > _RETRIES:
                    raise StoreError(
                        f"{what}: the connection to the store at {self._where} keeps dropping"
                    )
                continue
            answer = pending.answer or {}
            if answer.get("ok") is True:
                return answer.get("result")
            raise p.error_from_code(answer.get("code"), str(answer.get("message")))

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
        if not ttl > 0:
            raise StoreError(f"a lease needs a positive ttl, got {ttl}")
        # Retrying is harmless: a lease granted on a connection that then dropped is
        # orphaned, never resumed (we never learnt its id), and revoked after the grace.
        lease = _int(
            self._call("grant_lease", {"ttl": ttl}, retry=True, what=f"grant_lease({ttl})")
        )
        with self._lock:
            self._leases.add(lease)
        return lease

    def keep_alive(self, lease: int) -> bool:
        alive = bool(
            self._call("keep_alive", {"lease": lease}, retry=True, what=f"keep_alive({lease})")
        )
        if not alive:
            with self._lock:
                self._leases.discard(lease)
        return alive

    def revoke_lease(self, lease: int) -> None:
        with self._lock:
            self._leases.discard(lease)  # first: a reconnect must not resume it
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
        result = self._call(
            "watch",
            {"prefix": prefix, "after": after_revision},
            retry=True,
            what=f"watch({prefix!r})",
            wait_until=until,
            scope=scope,
        )
        return p.watch_from_wire(result)

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
        self._closed.set()
        self._life.cancel("the client was closed")
        with self._lock:
            conn, dialing, threads = self._conn, self._dialing, list(self._threads)
        if dialing is not None:
            with contextlib.suppress(OSError):
                dialing.shutdown(socket.SHUT_RDWR)
        if conn is not None:
            conn.abort()
        for thread in threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(_JOIN_TIMEOUT)
        self._life.close()

    def __enter__(self) -> TcpStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        conn = self._conn
        state = (
            "closed"
            if self._closed.is_set()
            else ("connected" if conn is not None and conn.alive else "disconnected")
        )
        return f"TcpStore({self._where}, {state}, leases={sorted(self._leases)})"


def _connect(address: tuple[str, int], timeout: float, scope: CancelScope) -> socket.socket:
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


class _Refused(Exception):
    """The server turned this client away for good (not a transient failure)."""


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StoreError(f"the store answered {value!r} where a number was expected")
    return value
