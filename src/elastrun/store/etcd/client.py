"""The etcd store: the store model on an etcd v3 cluster (see the package docstring).

Requests, the members and failover between them are ``transport``'s: a read, keep-alive,
revoke, watch or lease grant may be repeated on another member, any other write that may
have been applied raises ``StoreError`` saying its outcome is unknown.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import socket
import ssl
from collections.abc import Sequence
from typing import TYPE_CHECKING

from elastrun.core.cancel import CancelScope, scope_or_default
from elastrun.core.clock import Deadline
from elastrun.core.errors import (
    LeaseExpiredError,
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import EventKind, WatchEvent, WatchResult, check_lease_ttl
from elastrun.store.etcd.gateway import (
    Json,
    MaybeApplied,
    NotSent,
    b64,
    decode,
    describe,
    prefix_end,
    stream_message,
    to_int,
    unb64,
)
from elastrun.store.etcd.transport import Transport, past_deadline

if TYPE_CHECKING:
    import httpx

#: etcd hands the history a new watch asks for to it from a background loop that runs
#: every 100 ms; only after that long is "no event" an answer to trust.
HISTORY_GRACE = 0.3
#: A member that does not acknowledge a new watch within this long is taken as hung
#: (a healthy one does in milliseconds; shorter waits are a caller's quick look).
_HANG = 0.5


class EtcdStore:
    """A ``Store`` on an etcd v3 cluster, through the members' JSON gateway (thread-safe).

    Args:
        endpoints: the members, as accepted by :func:`parse_endpoints`.
        namespace: prepended to every key (and removed from keys read back), so that
            several users share one cluster without seeing each other's keys.
        ssl_context: client TLS (see :func:`tls_context`); None uses the system's CAs
            for ``https`` endpoints.
        username, password: etcd authentication (the token is fetched on first use and
            again whenever etcd says it expired).
        connect_timeout: the longest wait for one member to accept a connection.
        request_timeout: the longest a call keeps trying (every member, with backoff)
            before it raises ``StoreError``; also bounds a single answer.

    Constructing it does no I/O; a wrong endpoint shows on the first call.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        namespace: str = "",
        ssl_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        connect_timeout: float = 2.0,
        request_timeout: float = 10.0,
    ) -> None:
        self._transport = Transport(
            endpoints,
            ssl_context=ssl_context,
            username=username,
            password=password,
            connect_timeout=connect_timeout,
            request_timeout=request_timeout,
        )
        self._namespace = namespace.encode()

    # -- keys ------------------------------------------------------------------------

    def _k(self, key: str) -> bytes:
        return self._namespace + key.encode()

    def _unk(self, raw: str | None) -> str:
        return unb64(raw)[len(self._namespace) :].decode(errors="replace")

    def _range_body(self, prefix: str) -> Json:
        start = self._k(prefix)
        return {"key": b64(start or b"\0"), "range_end": b64(prefix_end(start))}

    # -- the store model ---------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": b64(self._k(key))}, safe=True).get("kvs")
        return unb64(kvs[0].get("value")) if kvs else None

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        put: Json = {"key": b64(self._k(key)), "value": b64(value)}
        if lease is not None:
            put["lease"] = str(lease)
        return to_int(self._call("/v3/kv/put", put, safe=False)["header"].get("revision"))

    def add(self, key: str, amount: int) -> int:
        k = b64(self._k(key))
        kv: Json | None = self._first_kv(self._call("/v3/kv/range", {"key": k}, safe=True))
        while True:
            raw = unb64(kv.get("value")) if kv else b"0"
            try:
                value = int(raw) + amount
            except ValueError:
                raise StoreError(f"add: value of {key!r} is not an integer: {raw!r}") from None
            put: Json = {"key": k, "value": b64(str(value).encode())}
            if kv and to_int(kv.get("lease")):
                put["lease"] = kv["lease"]  # a leased counter stays bound to its lease
            unchanged = (
                {"key": k, "target": "MOD", "mod_revision": kv["mod_revision"]}
                if kv
                else {"key": k, "target": "CREATE", "create_revision": "0"}
            )
            try:
                answer = self._txn(unchanged, put, k)
            except LeaseExpiredError:  # the counter's lease ended meanwhile, and the key with it
                kv = self._first_kv(self._call("/v3/kv/range", {"key": k}, safe=True))
                continue
            if answer.get("succeeded"):
                return value
            kv = self._first_kv(answer["responses"][0]["response_range"])

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        k = b64(self._k(key))
        compare = (
            {"key": k, "target": "CREATE", "create_revision": "0"}
            if expected is None
            else {"key": k, "target": "VALUE", "value": b64(expected)}
        )
        put: Json = {"key": k, "value": b64(value)}
        if lease is not None:
            put["lease"] = str(lease)
        answer = self._txn(compare, put, k)
        if answer.get("succeeded"):
            return True, bytes(value)
        kv = self._first_kv(answer["responses"][0]["response_range"])
        return False, unb64(kv.get("value")) if kv else None

    def delete(self, key: str) -> bool:
        answer = self._call("/v3/kv/deleterange", {"key": b64(self._k(key))}, safe=False)
        return to_int(answer.get("deleted")) > 0

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        answer = self._call("/v3/kv/range", self._range_body(prefix), safe=True)
        found = {self._unk(kv["key"]): unb64(kv.get("value")) for kv in answer.get("kvs", [])}
        return found, to_int(answer["header"].get("revision"))

    def grant_lease(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds, rounded up to whole seconds (etcd's unit).

        etcd also raises a TTL below its minimum (about 1.5 election timeouts) to that
        minimum. The lease id is chosen here, so that a grant whose answer was lost can
        be repeated: "lease already exists" then means the first attempt took effect.
        """
        check_lease_ttl(ttl)
        lease = random.SystemRandom().randrange(1, 2**62)
        body = {"TTL": str(max(1, math.ceil(ttl))), "ID": str(lease)}
        try:
            self._call("/v3/lease/grant", body, safe=True)
        except StoreError as exc:
            if "lease already exists" not in str(exc):
                raise
        return lease

    def keep_alive(self, lease: int) -> bool:
        try:
            answer = self._call("/v3/lease/keepalive", {"ID": str(lease)}, safe=True)
        except LeaseExpiredError:
            return False
        # The gateway wraps a stream's messages in "result"; an unknown lease has TTL 0.
        return to_int(answer.get("result", answer).get("TTL")) > 0

    def revoke_lease(self, lease: int) -> None:
        # Unknown, expired, or revoked by an attempt whose answer was lost:
        with contextlib.suppress(LeaseExpiredError):
            self._call("/v3/lease/revoke", {"ID": str(lease)}, safe=True)

    def compact(self, revision: int) -> None:
        """Discard the history before ``revision`` (watches from earlier then fail with
        ``StoreCompactedError``); etcd operators usually let auto-compaction do this."""
        with contextlib.suppress(StoreCompactedError):  # already compacted at or past it
            self._call("/v3/kv/compaction", {"revision": str(revision)}, safe=True)

    def watch(
        self,
        prefix: str,
        after_revision: int,
        timeout: float,
        *,
        scope: CancelScope | None = None,
    ) -> WatchResult:
        """Changes under ``prefix`` after ``after_revision`` (see ``Store.watch``).

        An empty answer resumes from ``after_revision`` itself, not from the cluster's
        newer revision: a one-shot gateway stream has no progress marker proving that
        etcd already delivered everything up to that revision, and skipping ahead could
        lose an event it had not yet sent.

        Cancelling ``scope`` shuts the stream's connection down, which ends the read at
        once (the connect itself is bounded by ``connect_timeout``); its deadline ends
        the watch with ``StoreTimeoutError``.
        """
        live = scope_or_default(scope)
        live.raise_if_cancelled()
        if live.expired():
            raise past_deadline("watch", "", unknown=False)
        deadline = Deadline.after(timeout)
        body = {
            "create_request": {
                **self._range_body(prefix),
                "start_revision": str(after_revision + 1),
            }
        }

        def attempt(url: str, wait: float) -> WatchResult:
            try:
                return self._read_watch(url, body, after_revision, deadline, live)
            except (MaybeApplied, NotSent):
                live.raise_if_cancelled()  # the cancellation cut the stream: say so
                raise

        # Connection trouble gets the usual failover window even for a short watch.
        result = self._transport.with_failover(
            attempt, safe=True, what="watch", window=max(timeout, 0), scope=live
        )
        if not result.events and live.deadline.expired() and not deadline.expired():
            raise past_deadline("watch", "", unknown=False)  # cut short by the scope
        return result

    def wait(self, keys: list[str], timeout: float, *, scope: CancelScope | None = None) -> None:
        deadline = Deadline.after(timeout)
        while True:
            missing, revision = [], math.inf
            for key in keys:
                body = {"key": b64(self._k(key)), "count_only": True}
                answer = self._call("/v3/kv/range", body, safe=True, scope=scope)
                revision = min(revision, to_int(answer["header"].get("revision")))
                if not to_int(answer.get("count")):
                    missing.append(key)
            if not missing:
                return
            if deadline.expired():
                raise StoreTimeoutError(f"timed out after {timeout}s waiting for {missing}")
            # One watch over the keys' common prefix (characters, not path parts):
            prefix = os.path.commonprefix(missing)  # noqa: RUF071
            self.watch(prefix, int(revision), deadline.remaining(), scope=scope)

    def close(self) -> None:
        self._transport.close()

    def __repr__(self) -> str:
        t = self._transport
        return (
            f"EtcdStore(endpoints={list(t.urls)}, using={t.using!r}, "
            f"namespace={self._namespace.decode()!r}, user={t.username!r}, closed={t.closed})"
        )

    # -- requests and transactions -----------------------------------------------------

    def _txn(self, compare: Json, put: Json, key: str) -> Json:
        body = {
            "compare": [{"result": "EQUAL", **compare}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": key}}],
        }
        return self._call("/v3/kv/txn", body, safe=False)

    def _call(self, path: str, body: Json, *, safe: bool, scope: CancelScope | None = None) -> Json:
        return self._transport.call(path, body, safe=safe, scope=scope)

    @staticmethod
    def _first_kv(answer: Json) -> Json | None:
        kvs = answer.get("kvs")
        return kvs[0] if kvs else None

    # -- watches ---------------------------------------------------------------------

    def _read_watch(
        self, url: str, body: Json, after: int, deadline: Deadline, scope: CancelScope
    ) -> WatchResult:
        import httpx

        # A read waits at least one history-delivery period (see HISTORY_GRACE), and
        # never past the scope's deadline.
        wait = scope.remaining(max(deadline.remaining(), HISTORY_GRACE))
        created = synced = False
        try:
            with (
                self._transport.stream(url, "/v3/watch", body, wait) as reply,
                scope.wakes(functools.partial(_cut, reply)),
            ):
                if reply.status_code != 200:
                    decode(reply.status_code, reply.read(), url)
                for line in reply.iter_lines():
                    if not line.strip():
                        continue
                    result = stream_message(json.loads(line), url)
                    if result.get("created"):
                        created = True
                        # Nothing older than the watch's start is pending: etcd sends
                        # only live changes to a watch that starts past its revision.
                        synced = after >= to_int(result.get("header", {}).get("revision"))
                    events = tuple(self._event(e) for e in result.get("events", ()))
                    if events:
                        return WatchResult(events, events[-1].revision)
                    if synced and (deadline.expired() or scope.expired()):
                        break
        except httpx.ReadTimeout:
            # Nothing happened in time -- unless the member never even opened the watch:
            # then it hangs, and another member should be asked.
            if not created and wait >= _HANG:
                raise MaybeApplied(f"no answer in {wait:.1f}s") from None
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NotSent(describe(exc)) from None
        except httpx.TransportError as exc:
            raise MaybeApplied(describe(exc)) from None
        return WatchResult((), after)

    def _event(self, raw: Json) -> WatchEvent:
        kv = raw["kv"]
        kind = EventKind.DELETE if raw.get("type") == "DELETE" else EventKind.PUT
        value = unb64(kv.get("value")) if kind is EventKind.PUT else None
        return WatchEvent(kind, self._unk(kv["key"]), value, to_int(kv["mod_revision"]))


def _cut(reply: httpx.Response) -> None:
    """Shut a streaming reply's connection down: a read blocked on it returns at once
    (closing the descriptor from another thread would not wake it)."""
    stream = reply.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
